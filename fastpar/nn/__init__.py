"""Drop-in tensor-parallel modules mirroring ``torch.nn``."""

from __future__ import annotations

from fastpar.mesh.placement import ParamLayout, param_layout
from fastpar.moe.layer import MoE, moe_aux_loss
from fastpar.nn.embedding import VocabParallelEmbedding, VocabShard
from fastpar.nn.fp8_apply import use_fp8
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.loss import VocabParallelCrossEntropy
from fastpar.nn.parallelize import parallelize
from fastpar.ops.fp8_linear import fp8_linear

__all__ = [
    "ColumnParallelLinear",
    "MoE",
    "ParamLayout",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabShard",
    "fp8_linear",
    "moe_aux_loss",
    "parallelize",
    "param_layout",
    "use_fp8",
]
