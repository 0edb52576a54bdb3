"""Each parameter says how it is laid out across ranks: sharded (along which dim, over which
group) or replicated (over which group). Gradient clipping and checkpointing read this mark
to count every element exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

_ATTR = "_fastpar_layout"


@dataclass(frozen=True)
class ParamLayout:
    """``kind`` "sharded": this rank holds a slice along ``dim`` of a tensor split over
    ``group``; "replicated": every rank of ``group`` holds the same tensor.
    ``full_size`` is the unpadded size along ``dim`` of the whole tensor (sharded only)."""

    kind: Literal["sharded", "replicated"]
    group: dist.ProcessGroup | None
    dim: int | None = None
    full_size: int | None = None
    fused: int = 1
    """Sharded only: the dim holds ``fused`` stacked blocks (q|k|v) and each rank keeps its
    1/world of every block, so local row i is global row
    ``(i // per) * (full_size // fused) + rank * per + i % per`` with ``per`` rows per block."""


def mark_sharded(
    p: torch.nn.Parameter,
    dim: int,
    group: dist.ProcessGroup | None,
    full_size: int,
    fused: int = 1,
) -> None:
    setattr(p, _ATTR, ParamLayout("sharded", group, dim, full_size, fused))


def mark_replicated(p: torch.nn.Parameter, group: dist.ProcessGroup | None) -> None:
    setattr(p, _ATTR, ParamLayout("replicated", group))


def param_layout(p: torch.Tensor) -> ParamLayout | None:
    """The mark of ``p``, or None for a parameter fastpar did not create (plain torch.nn)."""
    return getattr(p, _ATTR, None)


_DUPLICATED = "_fastpar_duplicated_over"
_EXPERT = "_fastpar_expert"


def mark_duplicated(p: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``p`` (whatever its TP layout) is held identically by every rank of ``group`` — e.g. a
    word embedding tied between the first and last pipeline stage (the mesh's embedding group)."""
    setattr(p, _DUPLICATED, (*getattr(p, _DUPLICATED, ()), group))


def duplicated_over(p: torch.Tensor) -> tuple:
    return getattr(p, _DUPLICATED, ())


@dataclass(frozen=True)
class ExpertLayout:
    """Dim 0 of an expert parameter indexes experts: this rank holds experts
    [rank · n, (rank + 1) · n) of ``num_experts``, split over ``group`` (the EP group; None
    when there is no expert parallelism)."""

    group: dist.ProcessGroup | None
    num_experts: int


def mark_expert(
    p: torch.Tensor, group: dist.ProcessGroup | None = None, num_experts: int | None = None
) -> None:
    """``p`` belongs to experts (dim 0 = local experts): replicated over the
    expert-data-parallel group, not the data-parallel group."""
    setattr(p, _EXPERT, ExpertLayout(group, num_experts if num_experts is not None else p.shape[0]))


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, _EXPERT, None) is not None


def expert_layout(p: torch.Tensor) -> ExpertLayout | None:
    return getattr(p, _EXPERT, None)


_TIED_NAME = "_fastpar_checkpoint_name"


def mark_tied_copy(p: torch.Tensor, name: str) -> None:
    """``p`` is this rank's copy of the global tensor ``name`` (the last pipeline stage's copy
    of a word embedding tied to the LM head): checkpoints save and load it as ``name``, whatever
    name the caller lists it under, so one global tensor serves every pipeline layout."""
    setattr(p, _TIED_NAME, name)


def tied_name(p: torch.Tensor) -> str | None:
    """The global name ``mark_tied_copy`` gave ``p``, or None."""
    return getattr(p, _TIED_NAME, None)
