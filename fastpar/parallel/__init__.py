"""Data parallelism (bucketed, overlapped all-reduce) and the ``GradSync`` protocol the pipeline
engine drives it through; ZeRO lives in ``fastpar.zero``."""

from __future__ import annotations

from fastpar.parallel.ddp import DistributedDataParallel
from fastpar.parallel.protocols import GradSync

__all__ = ["DistributedDataParallel", "GradSync"]
