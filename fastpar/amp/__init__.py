"""Mixed precision: loss scalers, the global grad norm and inf agreement."""

from __future__ import annotations

from fastpar.amp.norm import clip_grad_norm_, counts_on_this_rank, global_grad_norm
from fastpar.amp.scaler import ConstantLossScaler, DynamicLossScaler, LossScaleError

__all__ = [
    "ConstantLossScaler",
    "DynamicLossScaler",
    "LossScaleError",
    "clip_grad_norm_",
    "counts_on_this_rank",
    "global_grad_norm",
]
