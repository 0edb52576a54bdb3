"""Mixed precision: loss scalers, the global grad norm and inf agreement, the guarded step, and
the protocols optimizers declare to it (``fastpar.amp.protocols``)."""

from __future__ import annotations

from fastpar.amp.norm import clip_grad_norm_, counts_on_this_rank, global_grad_norm
from fastpar.amp.protocols import AmpOptimizer, FoldedAmpStep, FusedAmpStep
from fastpar.amp.scaler import ConstantLossScaler, DynamicLossScaler, LossScaleError

__all__ = [
    "AmpOptimizer",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "FoldedAmpStep",
    "FusedAmpStep",
    "LossScaleError",
    "clip_grad_norm_",
    "counts_on_this_rank",
    "global_grad_norm",
]
