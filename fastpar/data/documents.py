"""Packed documents: token streams with document boundaries (and an optional loss mask), and
the mini-batches whose rows start at a document start (Megatron's GPT dataset, in small).
Formats: docs/data.md."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from fastpar.data.tokens import (
    Tokens,
    _rows,
    _window_starts,
    encode_text,
    load_tokenizer,
    load_tokens,
)

#: end-of-document tokens looked up in a tokenizer, in this order, when ``eos_id`` is None
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
#: the target of a position that predicts nothing (torch's cross-entropy ``ignore_index``)
IGNORE_INDEX = -100


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
    ids = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    after = np.flatnonzero(ids == eos_id).astype(np.int64) + 1
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
