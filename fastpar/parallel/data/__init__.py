"""Data parallelism: one family over flat shards (``fastpar.parallel`` re-exports its names).
Its files: docs/architecture.md; how they work: docs/layouts.md ("The data-parallel family").
"""

from __future__ import annotations

from fastpar.parallel.data.ddp import DistributedDataParallel
from fastpar.parallel.data.flat import FlatShard
from fastpar.parallel.data.protocols import DataParallel, GradSync
from fastpar.parallel.data.replicate import Replicate, Shard

__all__ = ["DataParallel", "DistributedDataParallel", "FlatShard", "GradSync", "Replicate", "Shard"]
