"""The parameter marks, kept importable here for user code: they live in the bottom layer,
``fastpar.mesh.placement``, with the rule that reads them (which groups replicate a parameter)."""

from __future__ import annotations

from fastpar.mesh.placement import (
    ExpertLayout,
    ParamLayout,
    duplicated_over,
    expert_layout,
    is_expert,
    mark_duplicated,
    mark_expert,
    mark_owned,
    mark_replicated,
    mark_sharded,
    mark_tied_copy,
    param_layout,
    tied_name,
)

__all__ = [
    "ExpertLayout",
    "ParamLayout",
    "duplicated_over",
    "expert_layout",
    "is_expert",
    "mark_duplicated",
    "mark_expert",
    "mark_owned",
    "mark_replicated",
    "mark_sharded",
    "mark_tied_copy",
    "param_layout",
    "tied_name",
]
