"""Optimizers: a fused AdamW, and fp32 master weights around any torch optimizer."""

from __future__ import annotations

from fastpar.optim.fused_adamw import FusedAdamW
from fastpar.optim.mixed_precision import MixedPrecisionOptimizer

__all__ = ["FusedAdamW", "MixedPrecisionOptimizer"]
