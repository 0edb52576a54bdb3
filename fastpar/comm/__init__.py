"""Differentiable collectives (autograd Functions with an explicit group)."""

from __future__ import annotations

from fastpar.comm.collectives import (
    AllGatherReduceScatter,
    CopyToRegion,
    GatherFromRegion,
    ReduceFromRegion,
    ReduceScatterAllGather,
    ScatterToRegion,
    all_gather_reduce_scatter,
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_all_gather,
    scatter_to_region,
    scatter_to_sequence,
)

__all__ = [
    "AllGatherReduceScatter",
    "CopyToRegion",
    "GatherFromRegion",
    "ReduceFromRegion",
    "ReduceScatterAllGather",
    "ScatterToRegion",
    "all_gather_reduce_scatter",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence",
    "group_rank",
    "group_size",
    "reduce_from_region",
    "reduce_scatter_all_gather",
    "scatter_to_region",
    "scatter_to_sequence",
]
