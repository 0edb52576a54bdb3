"""Every collective of fastpar: differentiable ones (autograd Functions with an explicit group)
here, torch.distributed's non-differentiable ones wrapped as they are in ``fastpar.comm.plain``."""

from __future__ import annotations

from fastpar.comm.collectives import (
    AllGatherReduceScatter,
    AllToAll,
    CopyToRegion,
    GatherFromRegion,
    ReduceFromRegion,
    ReduceScatterAllGather,
    ScatterToRegion,
    all_gather_reduce_scatter,
    all_reduce_grad,
    all_to_all,
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
    "AllToAll",
    "CopyToRegion",
    "GatherFromRegion",
    "ReduceFromRegion",
    "ReduceScatterAllGather",
    "ScatterToRegion",
    "all_gather_reduce_scatter",
    "all_reduce_grad",
    "all_to_all",
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
