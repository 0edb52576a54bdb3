"""Parallelism over the mesh, in three packages: data parallelism (``fastpar.parallel.data``: one
family behind one protocol), context parallelism (``fastpar.parallel.context``: ring and
all-to-all attention) and the pipeline (``fastpar.parallel.pipeline``: schedules and engine).

``Replicate`` (stage 0: bucketed all-reduce overlapped with backward) and ``Shard`` (ZeRO
stages 1, 2, 3) share one constructor shape, ``(module, optimizer_factory, *, mesh, ...)``,
and one behaviour over ``FlatShard`` objects (a flat buffer, its padding, the range this rank
owns, its collectives); what every stage provides is the ``DataParallel`` protocol, and what
the pipeline engine drives is its ``GradSync`` part. ``DistributedDataParallel`` and
``fastpar.zero.ZeroOptimizer`` / ``Zero3`` are the same wrappers under their historical
signatures. This package re-exports the data-parallel names.
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
