"""Parallelism over the mesh, in three packages: data parallelism (``fastpar.parallel.data``: one
family behind one protocol), context parallelism (``fastpar.parallel.context``: ring and
all-to-all attention) and the pipeline (``fastpar.parallel.pipeline``: schedules and engine).
This package re-exports the data-parallel names (docs/layouts.md, "The data-parallel family").
"""

from __future__ import annotations

from fastpar.parallel.data import (
    DataParallel,
    DistributedDataParallel,
    FlatShard,
    GradSync,
    Replicate,
    Shard,
)

__all__ = ["DataParallel", "DistributedDataParallel", "FlatShard", "GradSync", "Replicate", "Shard"]
