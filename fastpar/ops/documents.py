"""Attention that stops at document boundaries, for packed rows (``fastpar.models.documents``).

    out = document_attention(q, k, v, doc_ids)   # q [B, Hq, T, D], k / v [B, Hkv, T, D]

``doc_ids`` [B, T] int64, non-decreasing along each row; read on the host once per call
(docs/kernels.md, "Document attention")."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "Documents",
    "causal_work",
    "current",
    "dense_document_attention",
    "document_attention",
    "document_starts",
    "documents",
    "valid_targets",
    "work_balance",
]


#: the documents of the running forward (a module global, not a ContextVar: torch.compile
#: traces a global's read, guarded, where it cannot trace ``ContextVar.get``)
_CURRENT: list = [None]


@dataclass(frozen=True)
class Documents:
    """The documents of a batch's rows: ``ids`` [B, S] int64 (see docs/kernels.md),
    whether positions restart at each document (``reset_positions``) and, optionally, which
    tokens have a valid target (``valid`` [B, S] bool, whole rows like ``ids``; e.g.
    ``targets != -100``): the MoE layers' aux losses and expert-bias counts count only those
    (``fastpar.moe.router``; None: every token)."""

    ids: torch.Tensor
    reset_positions: bool = True
    valid: torch.Tensor | None = None

    @staticmethod
    def of(
        ids: torch.Tensor, reset_positions: bool = True, valid: torch.Tensor | None = None
    ) -> Documents:
        if ids.dim() != 2:
            raise ValueError(f"document ids must be [batch, seq], got {tuple(ids.shape)}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"document ids must be int32 / int64, got {ids.dtype}")
        if valid is not None and (valid.dtype != torch.bool or valid.shape != ids.shape):
            raise ValueError(
                f"valid must be a bool [batch, seq] mask like the ids {tuple(ids.shape)}, got "
                f"{valid.dtype} {tuple(valid.shape)}"
            )
        return Documents(ids.long(), reset_positions, valid)

    def positions(self) -> torch.Tensor:
        """[B, S] int64: each token's position in its document (``reset_positions``) or in its
        row."""
        b, s = self.ids.shape
        pos = torch.arange(s, device=self.ids.device).expand(b, s)
        if not self.reset_positions:
            return pos
        return pos - document_starts(self.ids)

    def rows(self, index) -> Documents:
        """The documents of some rows (``index`` a slice or an index tensor of dim 0)."""
        valid = None if self.valid is None else self.valid[index]
        return Documents(self.ids[index], self.reset_positions, valid)


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: for each position, the position where its document starts in the row."""
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device).expand(b, s)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values


def current() -> Documents | None:
    """The documents of the forward that is running (None: plain causal rows)."""
    return _CURRENT[0]


@contextlib.contextmanager
def documents(docs: Documents | torch.Tensor | None):
    """Run the enclosed forwards on rows of these documents (``docs`` a ``Documents``, the ids
    [B, S], or None: plain causal rows)."""
    if isinstance(docs, torch.Tensor):
        docs = Documents.of(docs)
    before, _CURRENT[0] = _CURRENT[0], docs
    try:
        yield docs
    finally:
        _CURRENT[0] = before


def valid_targets(targets: torch.Tensor, ignore_index: int = -100) -> int:
    """The count of valid targets of a batch still on the host (the loader's CPU tensor, before
    it moves to a device: a read of host memory, no device sync)."""
    if targets.device.type != "cpu":
        raise ValueError(
            f"valid_targets counts a host batch; got targets on {targets.device} (count them "
            "before moving the batch, or let PipelineEngine all-reduce the count)"
        )
    return int(torch.count_nonzero(targets != ignore_index))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor) -> None:
    dims_ok = q.dim() == k.dim() == v.dim() == 4 and q.shape[-1] == k.shape[-1]
    if not dims_ok or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q must be [B, Hq, T, D], k [B, Hkv, T, D] and v [B, Hkv, T, Dv], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, hq, t, _ = q.shape
    if k.shape[0] != b or k.shape[2] != t or hq % k.shape[1]:
        raise ValueError(
            f"k / v {tuple(k.shape)} do not fit q {tuple(q.shape)}: same batch and length, "
            f"query heads a multiple of key/value heads"
        )
    if tuple(doc_ids.shape) != (b, t):
        raise ValueError(f"doc_ids must be [batch, seq] = {(b, t)}, got {tuple(doc_ids.shape)}")


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """K/V heads repeated for grouped-query attention (head j serves query heads j·rep ..
    j·rep + rep - 1, as ``fastpar.models.common.attend``)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k, v


def document_lengths(doc_ids: torch.Tensor) -> list[tuple[int, ...]]:
    """Per row, the lengths of its documents in order (one host read of ``doc_ids``)."""
    ids = doc_ids.detach().to("cpu")
    out = []
    for row in ids:
        if row.numel() and bool((row[1:] < row[:-1]).any()):
            raise ValueError("doc_ids must be non-decreasing along each row (packed documents)")
        out.append(tuple(torch.unique_consecutive(row, return_counts=True)[1].tolist()))
    return out


def _document_attention(q, k, v, doc_ids, scale):
    _check(q, k, v, doc_ids)
    k, v = _expand_kv(q, k, v)
    lengths = document_lengths(doc_ids)
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, lens in enumerate(lengths):
        groups.setdefault(lens, []).append(row)
    pieces, order = [], []
    for lens, rows in groups.items():
        if len(groups) == 1:
            qg, kg, vg = q, k, v
        else:
            idx = torch.tensor(rows, device=q.device)
            qg, kg, vg = q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx)
        segs, start = [], 0
        for n in lens:
            end = start + n
            segs.append(
                F.scaled_dot_product_attention(
                    qg[:, :, start:end],
                    kg[:, :, start:end],
                    vg[:, :, start:end],
                    is_causal=True,
                    scale=scale,
                )
            )
            start = end
        pieces.append(segs[0] if len(segs) == 1 else torch.cat(segs, dim=2))
        order += rows
    if len(pieces) == 1:
        return pieces[0]
    out = torch.cat(pieces, dim=0)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return out.index_select(0, inverse.to(out.device))


_EAGER: list = []


def _eager():
    """``_document_attention`` under ``torch.compiler.disable``, wrapped at first use so that
    ``import fastpar`` does not import torch._dynamo."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_document_attention))
    return _EAGER[0]


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention that stops at documents: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv,
    T, Dv] (Hq a multiple of Hkv: grouped-query; Dv may differ from D), ``doc_ids`` [B, T]
    non-decreasing per row -> [B, Hq, T, Dv]; a query sees the keys of its own document at or
    before it. ``scale`` default 1/sqrt(D).

    One causal SDPA call per document (rows of equal document lengths batched together), no
    dense mask; reads ``doc_ids`` to the host once per call (a synchronisation on a GPU); a
    graph break under torch.compile. Any floating dtype SDPA takes (float64 included)."""
    return _eager()(q, k, v, doc_ids, scale)


def dense_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The reference of ``document_attention``: a dense [B, 1, T, T] boolean mask (same
    document and causal) and plain softmax math. For tests and benchmarks only (T² memory)."""
    _check(q, k, v, doc_ids)
    k, v = _expand_kv(q, k, v)
    t = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal  # [B, T, T]
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def causal_work(doc_lengths_per_row: Sequence[Sequence[int]], seq: int, cp: int) -> list[int]:
    """Per context-parallel rank, the (query, key) pairs it computes when attention stops at
    documents, summed over rows: the sequence of ``seq`` tokens is cut into 2·cp equal chunks
    and rank i holds chunks i and 2cp−1−i (``fastpar.parallel.context.local_positions``); the
    query at position p of a document starting at s sees p − s + 1 keys. ``doc_lengths_per_row``:
    each row's document lengths (summing to ``seq``)."""
    if cp < 1 or seq % (2 * cp):
        raise ValueError(f"seq {seq} must be divisible by 2*cp = {2 * cp} (cp >= 1)")
    c = seq // (2 * cp)
    chunk = torch.arange(seq) // c
    rank = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
    total = torch.zeros(cp, dtype=torch.int64)
    for lens in doc_lengths_per_row:
        lens = torch.as_tensor(list(lens), dtype=torch.int64)
        if int(lens.sum()) != seq or bool((lens < 1).any()):
            raise ValueError(f"document lengths must be >= 1 and sum to seq {seq}")
        starts = torch.cumsum(lens, 0) - lens
        seen = torch.arange(seq) - starts.repeat_interleave(lens) + 1
        total += torch.zeros(cp, dtype=torch.int64).index_add_(0, rank, seen)
    return total.tolist()


def work_balance(counts: Sequence[int]) -> float:
    """max / mean of per-rank work (1.0: perfectly balanced)."""
    counts = list(counts)
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 1.0
