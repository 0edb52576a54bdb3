"""Functional forms of fastpar's parallel ops (mirrors ``torch.nn.functional``)."""

from __future__ import annotations

from fastpar.ops.cross_entropy import vocab_parallel_cross_entropy
from fastpar.ops.linear_cross_entropy import vocab_parallel_linear_cross_entropy

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy"]
