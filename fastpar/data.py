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
from dataclasses import dataclass

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


# --------------------------------------------------------------------------------------------
# Packed documents: token streams with document boundaries (and an optional loss mask), and
# the mini-batches whose rows start at a document start (Megatron's GPT dataset, in small).
# --------------------------------------------------------------------------------------------

#: end-of-document tokens looked up in a tokenizer, in this order, when ``eos_id`` is None
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
#: the target of a position that predicts nothing (torch's cross-entropy ``ignore_index``)
IGNORE_INDEX = -100


def _as_numpy(tokens: Tokens) -> np.ndarray:
    return tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)


def _check_starts(starts: np.ndarray, n: int, source: str, fix: str) -> None:
    """ValueError (one line) unless ``starts`` is 1-D, begins at 0, strictly increases and
    stays below ``n``."""
    if starts.ndim != 1 or len(starts) == 0:
        raise ValueError(f"{source}: no document start offsets (shape {starts.shape}): {fix}")
    if starts[0] != 0:
        raise ValueError(f"{source}: the first document starts at {starts[0]}, not 0: {fix}")
    steps = np.diff(starts)
    if len(steps) and (bad := np.flatnonzero(steps <= 0)).size:
        i = int(bad[0]) + 1
        raise ValueError(
            f"{source}: document start offset {starts[i]} (entry {i}) does not follow "
            f"{starts[i - 1]}; offsets must strictly increase: {fix}"
        )
    if starts[-1] >= n:
        raise ValueError(
            f"{source}: document start offset {starts[-1]} is past the last token "
            f"(there are {n}): {fix}"
        )


@dataclass
class Corpus:
    """Token ids cut into documents: ``tokens`` (see ``Tokens``), ``starts`` (np.int64 offsets
    of each document's first token: 0 first, strictly increasing, each < len(tokens)) and
    ``loss_mask`` (1-D 0/1 per token: 1 = the token counts as a prediction target; None = all
    count). ``corpus[a:b]`` is the token range [a, b) as a Corpus of its own."""

    tokens: Tokens
    starts: np.ndarray
    loss_mask: np.ndarray | None = None
    source: str = "corpus"

    def __post_init__(self):
        self.starts = np.asarray(self.starts, dtype=np.int64)
        n = len(self.tokens)
        _check_starts(self.starts, n, self.source, "pass offsets 0 = s0 < s1 < ... < len(tokens)")
        if self.loss_mask is not None:
            mask = np.asarray(self.loss_mask)
            if mask.ndim != 1 or len(mask) != n:
                raise ValueError(
                    f"{self.source}: the loss mask has shape {mask.shape} but there are {n} "
                    f"tokens: pass one 0/1 value per token"
                )
            self.loss_mask = mask

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def has_boundaries(self) -> bool:
        """More than one document, or a loss mask: batches need ``document_batch``."""
        return len(self.starts) > 1 or self.loss_mask is not None

    def __getitem__(self, key: slice) -> Corpus:
        if not isinstance(key, slice):
            raise TypeError(f"a Corpus is sliced (corpus[a:b]), not indexed with {key!r}")
        a, b, step = key.indices(len(self))
        if step != 1:
            raise ValueError(f"a Corpus slice takes step 1, got {key.step}")
        if b <= a:
            raise ValueError(f"{self.source}[{a}:{b}] holds no tokens: pass a range a < b")
        inside = self.starts[(self.starts > a) & (self.starts < b)] - a
        starts = np.concatenate([np.zeros(1, np.int64), inside])
        mask = None if self.loss_mask is None else self.loss_mask[a:b]
        return Corpus(self.tokens[a:b], starts, mask, f"{self.source}[{a}:{b}]")


def tokenizer_eos_id(tokenizer: str | None) -> int | None:
    """The tokenizer's end-of-document id (the first of ``EOS_TOKENS`` it has), or None."""
    if tokenizer is None:
        return None
    tok = load_tokenizer(tokenizer)
    for name in EOS_TOKENS:
        if (i := tok.token_to_id(name)) is not None:
            return int(i)
    return None


def _read_idx(path: str, n: int) -> np.ndarray:
    size = os.path.getsize(path)
    fix = (
        "write the document start offsets as raw little-endian int64 "
        "(np.asarray(starts, '<i8').tofile(path)), 0 first, strictly increasing, each below "
        "the number of tokens, or delete the file to split at eos tokens"
    )
    if size == 0 or size % 8:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number (>0) of int64 offsets: {fix}"
        )
    starts = np.fromfile(path, dtype="<i8").astype(np.int64)
    _check_starts(starts, n, path, fix)
    return starts


def eos_starts(tokens: Tokens, eos_id: int | None) -> np.ndarray:
    """Document start offsets of token ids cut after every ``eos_id`` (None: one document)."""
    n = len(tokens)
    if eos_id is None:
        return np.zeros(1, np.int64)
    after = np.flatnonzero(_as_numpy(tokens) == eos_id).astype(np.int64) + 1
    return np.concatenate([np.zeros(1, np.int64), after[after < n]])


def _jsonl_document(obj, where: str, tokenizer: str | None, eos_id: int | None):
    """(ids, mask) of one JSONL record, both lists of ints."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a {type(obj).__name__}, not a JSON object")
    if "input_ids" in obj:
        ids, mask = obj["input_ids"], obj.get("loss_mask")
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ValueError(f"{where}: input_ids must be a list of non-negative integers")
        if mask is None:
            mask = [1] * len(ids)
        if not isinstance(mask, list) or not all(
            m in (0, 1) and not isinstance(m, float) for m in mask
        ):
            raise ValueError(f"{where}: loss_mask must be a list of 0/1 values")
        if len(mask) != len(ids):
            raise ValueError(
                f"{where}: {len(ids)} input_ids but {len(mask)} loss_mask values; pass one per id"
            )
        mask = [int(m) for m in mask]
    elif "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: prompt and completion must be strings")

        def enc(text: str) -> list[int]:
            if not text:
                return []
            if tokenizer is None:
                return list(text.encode("utf-8"))
            return encode_text(text, tokenizer).tolist()

        p, c = enc(prompt), enc(completion)
        tail = [] if eos_id is None else [int(eos_id)]
        ids = p + c + tail
        mask = [0] * len(p) + [1] * (len(c) + len(tail))
    else:
        raise ValueError(
            f"{where}: expected {{'prompt': str, 'completion': str}} or "
            f"{{'input_ids': [...], 'loss_mask': [...]}}, got keys {sorted(obj)}"
        )
    if not ids:
        raise ValueError(f"{where}: the document has no tokens; drop the line or give it text")
    return ids, mask


def _load_jsonl(path: str, tokenizer: str | None, eos_id: int | None) -> Corpus:
    import json

    ids: list[int] = []
    mask: list[int] = []
    starts: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not a JSON object ({exc.msg})") from exc
            doc, doc_mask = _jsonl_document(obj, where, tokenizer, eos_id)
            starts.append(len(ids))
            ids.extend(doc)
            mask.extend(doc_mask)
    if not ids:
        raise ValueError(f"{path} holds no documents: write one JSON object per line")
    return Corpus(
        torch.tensor(ids, dtype=torch.int64),
        np.asarray(starts, dtype=np.int64),
        np.asarray(mask, dtype=np.uint8),
        path,
    )


def index_file(path: str | None) -> str | None:
    """The document index beside a ``.bin`` token file (``X.idx`` beside ``X.bin``), if any."""
    if path is None or not path.endswith(".bin"):
        return None
    idx = path[: -len(".bin")] + ".idx"
    return idx if os.path.isfile(idx) else None


def load_documents(
    path: str | None,
    *,
    tokenizer: str | None = None,
    dtype: str = "uint16",
    eos_id: int | None = None,
) -> Corpus:
    """A ``Corpus`` from ``path``: a ``.jsonl`` of {"prompt", "completion"} or {"input_ids",
    "loss_mask"} records (one document each); a ``.bin`` with an ``.idx`` beside it (raw
    little-endian int64 document start offsets); or any ``load_tokens`` source, cut after
    every ``eos_id`` token (None: the tokenizer's end-of-document token, if any; no tokenizer
    and no eos_id: one document)."""
    if eos_id is None:
        eos_id = tokenizer_eos_id(tokenizer)
    if path is not None and path.endswith(".jsonl"):
        if not os.path.isfile(path):
            raise ValueError(f"data file {path!r} does not exist")
        return _load_jsonl(path, tokenizer, eos_id)
    tokens = load_tokens(path, tokenizer=tokenizer, dtype=dtype)
    idx = index_file(path)
    if idx is not None:
        return Corpus(tokens, _read_idx(idx, len(tokens)), None, path)
    return Corpus(tokens, eos_starts(tokens, eos_id), None, path or "the embedded corpus")


def document_batch(corpus: Corpus, step: int, batch: int, seq: int, seed: int):
    """The mini-batch of ``step`` over packed documents: [batch, seq] int64 inputs ``x``,
    targets ``y`` and ``doc_ids``. The rows are ``global_batch``'s windows (the same tokens as
    the stream mode: every token of a long document is reached); ``doc_ids[r, t]`` is the
    index, counted from the row's first token, of the document input position ``t`` belongs to
    (the row's first tokens, up to the first document start, are a document too: the tail of
    one cut by the window, as Megatron's packed datasets have it); a target is IGNORE_INDEX
    where it lies in another document than its input (a document's last token does not
    predict the next one's first) or its loss mask is 0 (a prompt token)."""
    starts = _window_starts(len(corpus), step, batch, seq, seed)
    idx = starts[:, None] + torch.arange(seq + 1)
    rows = _rows(corpus.tokens, idx)
    pos = idx.numpy()
    doc = np.searchsorted(corpus.starts, pos, side="right") - 1
    doc -= doc[:, :1]
    ignore = doc[:, 1:] != doc[:, :-1]
    if corpus.loss_mask is not None:
        ignore |= np.asarray(corpus.loss_mask)[pos[:, 1:]] == 0
    y = rows[:, 1:].clone()
    y[torch.from_numpy(ignore)] = IGNORE_INDEX
    doc_ids = torch.from_numpy(np.ascontiguousarray(doc[:, :-1])).long()
    return rows[:, :-1].contiguous(), y, doc_ids
