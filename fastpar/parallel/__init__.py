"""Data parallelism — one family behind one protocol — and the pipeline engine.

``Replicate`` (stage 0: bucketed all-reduce overlapped with backward) and ``Shard`` (ZeRO
stages 1, 2, 3) share one constructor shape, ``(module, optimizer_factory, *, mesh, ...)``,
and one behaviour over ``FlatShard`` objects (a flat buffer, its padding, the range this rank
owns, its collectives); what every stage provides is the ``DataParallel`` protocol, and what
the pipeline engine drives is its ``GradSync`` part. ``DistributedDataParallel`` (here) and
``fastpar.zero.ZeroOptimizer`` / ``Zero3`` are the same wrappers under their historical
signatures. The pipeline schedules and engine are in ``fastpar.parallel.pipeline``.
"""

from __future__ import annotations

from fastpar.parallel.ddp import DistributedDataParallel
from fastpar.parallel.flat import FlatShard
from fastpar.parallel.protocols import DataParallel, GradSync
from fastpar.parallel.replicate import Replicate, Shard

__all__ = ["DataParallel", "DistributedDataParallel", "FlatShard", "GradSync", "Replicate", "Shard"]
