"""Token data for ``fastpar.train``: where the ids come from, their check against the vocabulary,
and the deterministic mini-batch of every step.

    tokens = load_tokens("corpus.txt", tokenizer="tok.json")     # or bytes, .npy, .bin (uint16/32)
    check_token_ids(tokens, vocab_size=50304, source="train.bin")
    x, y = global_batch(tokens, step, batch=16, seq=64, seed=1234)

No path: the embedded corpus. ``tokenizers`` is imported only when used (``pip install
fastpar[hf]``). Sources: docs/training.md ("Data"); packed documents: docs/data.md."""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch

HF_HINT = "pip install fastpar[hf]"
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
#: the largest id a uint16 .bin file holds
UINT16_MAX = int(np.iinfo(np.uint16).max)

#: 1-D token ids: an int64 tensor (text) or a read-only memory-mapped numpy array (.npy / .bin)
Tokens = torch.Tensor | np.ndarray


def embedded_corpus() -> bytes:
    """Text that ships with every Python: the Zen of Python and the sources (with their
    docstrings) of a few standard-library modules (about 130 kB)."""
    import argparse as m1
    import ast
    import codecs
    import importlib.util
    import inspect
    import string as m2
    import textwrap as m3

    # `import this` would print the Zen; read its (rot13) text from the module's source instead
    with open(importlib.util.find_spec("this").origin) as f:
        tree = ast.parse(f.read())
    rot13 = next(
        n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "s"
    )
    zen = codecs.decode(rot13, "rot_13")
    return (zen + "\n" + "\n".join(inspect.getsource(m) for m in (m3, m2, m1))).encode()


def require_tokenizers():
    """The ``tokenizers`` module, or an ImportError that says how to install it."""
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(
            f"a tokenizer needs the Hugging Face `tokenizers` library: {HF_HINT}"
        ) from exc
    return tokenizers


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file (HF's format)."""
    tokenizers = require_tokenizers()
    if not os.path.isfile(path):
        raise ValueError(
            f"tokenizer file {path!r} does not exist: pass a tokenizer.json, or make one with "
            f"python -m fastpar.tokenizer --vocab-size 512 --out {path}"
        )
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # the library raises its own Exception type for a bad file
        raise ValueError(
            f"{path} is not a tokenizer.json that `tokenizers` can read: {exc}"
        ) from exc


def tokenizer_vocab_size(path: str) -> int:
    """Tokens in the tokenizer's vocabulary, added (special) tokens included."""
    return load_tokenizer(path).get_vocab_size(with_added_tokens=True)


def _read_text(path: str) -> str:
    data = _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not UTF-8 text (bad byte at offset {exc.start}): a tokenizer reads text; "
            f"convert the file, or pass pre-tokenised ids as .npy or .bin"
        ) from exc


#: a chunk boundary: after a newline, before a non-space character (byte-level BPE splits the
#: text into pieces there anyway, so chunks encode exactly as the whole text does)
_BOUNDARY = re.compile(r"\n(?=\S)")


def text_chunks(text: str, size: int = 1 << 16) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters at ``_BOUNDARY``s."""
    chunks, start = [], 0
    while start < len(text):
        m = _BOUNDARY.search(text, start + size) if start + size < len(text) else None
        end = m.end() if m is not None else len(text)
        chunks.append(text[start:end])
        start = end
    return chunks


def encode_text(text: str, tokenizer_path: str) -> torch.Tensor:
    """1-D int64 ids of ``text`` under the tokenizer (no special tokens added), encoded in
    parallel chunks cut where a byte-level pre-tokenizer splits anyway."""
    tok = load_tokenizer(tokenizer_path)
    encodings = tok.encode_batch(text_chunks(text), add_special_tokens=False)
    return torch.tensor([i for enc in encodings for i in enc.ids], dtype=torch.int64)


def bin_dtype(dtype: str | None, vocab_size: int, source: str) -> str:
    """The dtype to read a .bin file's ids as: ``dtype`` (None: uint16). A vocabulary whose
    ids pass 65535 needs uint32, given explicitly: uint32 ids read as uint16 would all be in
    range, so no later check could tell (ValueError, one line, otherwise)."""
    if dtype is not None and dtype not in BIN_DTYPES:
        raise ValueError(f"data dtype must be one of {sorted(BIN_DTYPES)}, got {dtype!r}")
    if vocab_size - 1 <= UINT16_MAX:
        return dtype or "uint16"
    if dtype is None:
        raise ValueError(
            f"{source}: the vocabulary has {vocab_size} tokens (ids up to {vocab_size - 1}), "
            f"more than uint16 ids hold (up to {UINT16_MAX}): pass --data-dtype uint32, the "
            f"dtype a .bin file of this vocabulary is written with"
        )
    if dtype == "uint16":
        raise ValueError(
            f"{source}: --data-dtype uint16 cannot hold the ids of a {vocab_size}-token "
            f"vocabulary (up to {vocab_size - 1}; uint16 ends at {UINT16_MAX}): pass "
            f"--data-dtype uint32 (and write the file as uint32), or a smaller --vocab-size"
        )
    return dtype


def _memmap_bin(path: str, dtype: str) -> np.ndarray:
    if dtype not in BIN_DTYPES:
        raise ValueError(f"data dtype must be one of {sorted(BIN_DTYPES)}, got {dtype!r}")
    item = np.dtype(BIN_DTYPES[dtype]).itemsize
    size = os.path.getsize(path)
    if size % item:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number of {dtype} ids ({item} bytes each): "
            f"pass the --data-dtype it was written with"
        )
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes): pass a .bin file of token ids")
    return np.memmap(path, dtype=BIN_DTYPES[dtype], mode="r")


def _load_npy(path: str) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r")
    except ValueError as exc:  # not a .npy file, or one of Python objects (pickled)
        raise ValueError(
            f"{path} is not a .npy array of token ids numpy can memory-map ({exc}): save the ids "
            f"with np.save(path, ids) from an integer array"
        ) from exc
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{path} holds {arr.dtype} values, not integer token ids: save the ids with an "
            f"integer dtype (e.g. np.uint16 / np.int32)"
        )
    if arr.ndim != 1:
        raise ValueError(
            f"{path} holds a {arr.ndim}-D array of shape {arr.shape}, not one stream of token "
            f"ids: save a 1-D array (e.g. np.save(path, ids.reshape(-1)) if its rows follow each "
            f"other in the text)"
        )
    return arr


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"{path} is empty (0 bytes): pass a text file with the training text")
    return data


def load_tokens(path: str | None = None, *, tokenizer: str | None = None, dtype: str = "uint16"):
    """1-D token ids (see ``Tokens``): a text file's bytes (or its ids under ``tokenizer``), a
    .npy array, a .bin file of ``dtype`` ids, or the embedded corpus (``path`` None)."""
    if path is not None and os.path.isdir(path):
        raise ValueError(f"data path {path!r} is a directory: pass one file of text or token ids")
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist")
    if path is not None and path.endswith(".npy"):
        return _load_npy(path)
    if path is not None and path.endswith(".bin"):
        return _memmap_bin(path, dtype)
    if tokenizer is not None:
        text = embedded_corpus().decode() if path is None else _read_text(path)
        return encode_text(text, tokenizer)
    data = embedded_corpus() if path is None else _read_bytes(path)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def check_token_ids(
    tokens: Tokens, vocab_size: int, source: str, *, min_tokens: int = 2, hint: str = ""
) -> None:
    """Raise ValueError (one line: the source, the offending id, the vocabulary size and the
    fix) unless every id is in [0, vocab_size) and there are at least ``min_tokens`` of them.
    One pass over the ids (a memory-mapped file is streamed)."""
    n = len(tokens)
    if n < min_tokens:
        fix = f"use more data or --seq-len {n - 2} or less" if n > 2 else "use more data"
        raise ValueError(
            f"{source}: {n} tokens, fewer than the {min_tokens} one sequence needs "
            f"(seq_len + 2): {fix}"
        )
    if isinstance(tokens, torch.Tensor):
        lo, hi = int(tokens.min()), int(tokens.max())
    else:
        lo, hi = int(np.min(tokens)), int(np.max(tokens))
    if lo < 0:
        raise ValueError(f"{source}: token id {lo} is negative; token ids start at 0{hint}")
    if hi >= vocab_size:
        raise ValueError(
            f"{source}: the largest token id is {hi} but the vocabulary has {vocab_size} tokens "
            f"(ids 0..{vocab_size - 1}); pass --vocab-size {hi + 1} or more, or the --tokenizer "
            f"the data was made with{hint}"
        )


def check_bin_width(tokens: np.ndarray, source: str, chunk: int = 1 << 20) -> None:
    """Raise ValueError when uint16 ids look like uint32 ids read two halves at a time: every
    second id 0 (the high halves) and the others not all 0. Stops at the first chunk of ids
    where a second id is not 0 (at once for real uint16 data)."""
    n = len(tokens) // 2 * 2
    if n < 64:
        return
    low_seen = False
    for start in range(0, n, chunk):
        pairs = np.asarray(tokens[start : min(start + chunk, n)]).reshape(-1, 2)
        if pairs[:, 1].any():
            return
        low_seen = low_seen or bool(pairs[:, 0].any())
    if low_seen:
        raise ValueError(
            f"{source}: every second uint16 id is 0, as when uint32 ids are read as uint16 "
            f"(their high halves): pass --data-dtype uint32"
        )


def _window_starts(n: int, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The first token of each row of ``step``'s mini-batch (windows of seq + 1 ids drawn at
    random from a generator seeded by ``seed`` and ``step``: the same on every rank)."""
    if n < seq + 2:
        raise ValueError(f"the corpus has {n} tokens, fewer than seq_len + 2 = {seq + 2}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n - seq - 1, (batch,), generator=g)


def _rows(tokens: Tokens, idx: torch.Tensor) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        return tokens[idx].long()
    return torch.from_numpy(np.asarray(tokens[idx.numpy()]).astype(np.int64))


def global_batch(tokens: Tokens, step: int, batch: int, seq: int, seed: int):
    """The mini-batch of ``step``: [batch, seq] int64 inputs and next-token targets, the same
    on every rank and every layout."""
    starts = _window_starts(len(tokens), step, batch, seq, seed)
    rows = _rows(tokens, starts[:, None] + torch.arange(seq + 1))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
