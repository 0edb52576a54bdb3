"""Packed documents: which document each token of a batch belongs to, for the attention and the
positions of the forward that is running.

    docs = Documents.of(doc_ids)                 # doc_ids [B, S]: a row's document index
    with documents(docs):                        # every block's forward inside reads it
        out = model(x)

A batch of packed rows carries ``doc_ids`` [B, S] (int64): in each row, the index of the
document each position belongs to, non-decreasing along the row (a document is one contiguous
run of equal ids; ids need not start at 0). Attention then stops at document boundaries
(a query sees the keys of its own document at or before it: ``fastpar.ops.documents.document_attention``), and
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

#: the documents of the running forward (a module global, not a ContextVar: torch.compile
#: traces a global's read, guarded, where it cannot trace ``ContextVar.get``)
_CURRENT: list = [None]


@dataclass(frozen=True)
class Documents:
    """The documents of a batch's rows: ``ids`` [B, S] int64 (see the module docstring),
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
