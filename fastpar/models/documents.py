"""Packed documents: which document each token of a batch belongs to, for the attention and the
positions of the forward that is running.

    docs = Documents.of(doc_ids)                 # doc_ids [B, S]: a row's document index
    with documents(docs):                        # every block's forward inside reads it
        out = model(x)

A batch of packed rows carries ``doc_ids`` [B, S] (int64): in each row, the index of the
document each position belongs to, non-decreasing along the row (a document is one contiguous
run of equal ids; ids need not start at 0). Attention then stops at document boundaries
(a query sees the keys of its own document at or before it: ``fastpar.ops.documents``), and
with ``reset_positions`` the positions restart at 0 at each document start (RoPE and learned
positions, as Megatron's ``reset_position_ids``).

The documents of the running micro-batch are a context (``documents(docs)``), not a block
input: every pipeline stage reads the micro-batch's documents from the data (every rank draws
the same global batch), so nothing extra travels between stages and blocks keep their
one-tensor signature; ``PipelineEngine`` enters the context around each forward and
recomputation (``context=``). The ids are those of whole rows (all ``S`` positions, also under
context parallelism, where each rank picks its chunks' from them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the documents of the running forward (a module global, not a ContextVar: torch.compile
#: traces a global's read, guarded, where it cannot trace ``ContextVar.get``)
_CURRENT: list = [None]


@dataclass(frozen=True)
class Documents:
    """The documents of a batch's rows: ``ids`` [B, S] int64 (see the module docstring) and
    whether positions restart at each document (``reset_positions``)."""

    ids: torch.Tensor
    reset_positions: bool = True

    @staticmethod
    def of(ids: torch.Tensor, reset_positions: bool = True) -> Documents:
        if ids.dim() != 2:
            raise ValueError(f"document ids must be [batch, seq], got {tuple(ids.shape)}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"document ids must be int32 / int64, got {ids.dtype}")
        return Documents(ids.long(), reset_positions)

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
        return Documents(self.ids[index], self.reset_positions)


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


def segments(ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each document: one read of the ids on the host (on a GPU
    one device-to-host copy of [B, S] ids per call)."""
    out = []
    for row in ids.cpu():
        _, counts = torch.unique_consecutive(row, return_counts=True)
        ends = counts.cumsum(0).tolist()
        out.append(list(zip([0, *ends[:-1]], ends, strict=True)))
    return out


def _document_attention(q, k, v, ids):
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # key/value head j serves query heads j·rep .. j·rep + rep - 1
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    rows = segments(ids)
    if all(len(r) == 1 for r in rows):  # one document a row: plain causal attention
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = []
    for b, row in enumerate(rows):
        pieces = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True
            )
            for s, e in row
        ]
        out.append(torch.cat(pieces, dim=2))
    return torch.cat(out, dim=0)


_EAGER: list = []


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor):
    """Causal attention that stops at documents: q [B, Hq, T, D], k / v [B, Hkv, T, D] (Hq a
    multiple of Hkv), ``ids`` [B, T] (each row's document ids, non-decreasing) -> [B, Hq, T,
    D]; a query sees the keys of its own document at or before it. Each document of each row
    is one causal ``scaled_dot_product_attention`` of its own tokens (torch's fused kernels;
    no [T, T] mask, memory and work as the documents' own lengths, not the row's). Run
    eagerly inside a compiled block (one graph break: the segments are read on the host)."""
    if ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"document ids {tuple(ids.shape)} do not match the queries' [batch, seq] "
            f"{(q.shape[0], q.shape[2])}"
        )
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_document_attention))
    return _EAGER[0](q, k, v, ids)


def valid_targets(targets: torch.Tensor, ignore_index: int = -100) -> int:
    """The count of valid targets of a batch still on the host (the loader's CPU tensor, before
    it moves to a device: a read of host memory, no device sync)."""
    if targets.device.type != "cpu":
        raise ValueError(
            f"valid_targets counts a host batch; got targets on {targets.device} (count them "
            "before moving the batch, or let PipelineEngine all-reduce the count)"
        )
    return int(torch.count_nonzero(targets != ignore_index))
