"""Drop-in tensor-parallel modules mirroring ``torch.nn``."""

from __future__ import annotations

from fastpar.nn.embedding import VocabParallelEmbedding, VocabShard
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.loss import VocabParallelCrossEntropy
from fastpar.nn.marks import ParamLayout, param_layout
from fastpar.nn.parallelize import parallelize

__all__ = [
    "ColumnParallelLinear",
    "ParamLayout",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabShard",
    "parallelize",
    "param_layout",
]
