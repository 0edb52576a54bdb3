"""Data parallelism (bucketed, overlapped all-reduce); ZeRO lives in ``fastpar.zero``."""

from __future__ import annotations

from fastpar.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
