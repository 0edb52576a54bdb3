"""This process's place in a process group: the one rank-in-group helper of fastpar.

``group`` None is the default group. Without an initialised torch.distributed every group is
this process alone: rank 0 of 1, so single-process code runs unchanged.
"""

from __future__ import annotations

import torch.distributed as dist

Group = dist.ProcessGroup | None


def group_rank(group: Group) -> int:
    """This process's rank in ``group`` (-1 if it is not a member); 0 without torch.distributed."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group: Group) -> int:
    """The number of ranks of ``group``; 1 without torch.distributed."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def global_rank(group: Group, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (``global_rank(g, 0)``: the rank that holds
    the reference copy of whatever ``g`` replicates, see ``fastpar.mesh.placement``)."""
    if group is None:
        return rank
    return dist.get_global_rank(group, rank)
