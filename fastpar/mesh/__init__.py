"""Rank bookkeeping: a flat world of ranks becomes TP / PP / DP / EP groups.

``rank_groups`` is the pure layout (no torch.distributed); ``ParallelMesh`` creates the process
groups of that layout on an initialised default group; ``init`` also initialises
torch.distributed from torchrun's environment.
"""

from __future__ import annotations

from fastpar.mesh.groups import ParallelMesh, init
from fastpar.mesh.layout import GROUP_KINDS, MeshLayout, rank_groups

__all__ = ["GROUP_KINDS", "MeshLayout", "ParallelMesh", "init", "rank_groups"]
