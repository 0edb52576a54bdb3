"""Rank bookkeeping: a flat world of ranks becomes TP / PP / DP / EP groups.

``rank_groups`` is the pure layout (no torch.distributed); ``ParallelMesh`` creates the process
groups of that layout on an initialised default group; ``init`` also initialises
torch.distributed from torchrun's environment. Every group gets one collective timeout
(``DEFAULT_TIMEOUT`` unless given; ``group_timeout`` reads a group's).

The bottom layer every other package asks: ``fastpar.mesh.placement`` (the parameter marks and
the one rule of which groups replicate a parameter, so which rank holds its reference copy) and
``fastpar.mesh.ranks`` (this process's rank in a group). ``fastpar.mesh.bridge``: to and from
torch's DeviceMesh (``ParallelMesh.to_device_mesh`` / ``from_device_mesh``, the same groups),
``restore_marks`` after FSDP2's ``fully_shard``. Only its command line (``__main__``)
imports another fastpar package.
"""

from __future__ import annotations

from fastpar.mesh.bridge import restore_marks
from fastpar.mesh.groups import ParallelMesh, init
from fastpar.mesh.layout import GROUP_KINDS, MeshLayout, rank_groups
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
