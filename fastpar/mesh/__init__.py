"""Rank bookkeeping: a flat world of ranks becomes TP / CP / PP / DP / EP groups.

``rank_groups`` is the pure layout; ``ParallelMesh`` creates its process groups (one collective
timeout each); ``init`` also initialises torch.distributed from torchrun's environment. The
bottom layer every package asks: ``placement`` (parameter marks, reference copies), ``ranks``
(rank in a group), ``bridge`` (torch's DeviceMesh). Only ``__main__`` imports another package."""

from __future__ import annotations

from fastpar.mesh.groups import ParallelMesh, init
from fastpar.mesh.layout import GROUP_KINDS, MeshLayout, rank_groups
from fastpar.mesh.placement import restore_marks
from fastpar.mesh.timeout import DEFAULT_TIMEOUT, group_timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "GROUP_KINDS",
    "MeshLayout",
    "ParallelMesh",
    "group_timeout",
    "init",
    "rank_groups",
    "restore_marks",
]
