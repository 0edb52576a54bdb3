"""Optimizers: a fused AdamW, Muon (``fastpar.optim.muon``), fp32 master weights around any torch optimizer, and the
checkpoint-pieces protocol optimizers implement (``fastpar.optim.pieces``)."""

from __future__ import annotations

from fastpar.optim.fused_adamw import FusedAdamW
from fastpar.optim.mixed_precision import MixedPrecisionOptimizer
from fastpar.optim.muon import Muon, is_hidden_matrix, muon_param_groups
from fastpar.optim.pieces import CheckpointPieces, KeyedLookup, ReplicatedPieces

__all__ = [
    "CheckpointPieces",
    "FusedAdamW",
    "KeyedLookup",
    "MixedPrecisionOptimizer",
    "Muon",
    "ReplicatedPieces",
    "is_hidden_matrix",
    "muon_param_groups",
]
