"""Optimizers: a fused AdamW, fp32 master weights around any torch optimizer, and the
checkpoint-pieces protocol optimizers implement (``fastpar.optim.pieces``)."""

from __future__ import annotations

from fastpar.optim.fused_adamw import FusedAdamW
from fastpar.optim.mixed_precision import MixedPrecisionOptimizer
from fastpar.optim.pieces import CheckpointPieces, KeyedLookup, ReplicatedPieces

__all__ = [
    "CheckpointPieces",
    "FusedAdamW",
    "KeyedLookup",
    "MixedPrecisionOptimizer",
    "ReplicatedPieces",
]
