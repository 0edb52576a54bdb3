"""Functional forms of fastpar's parallel ops (mirrors ``torch.nn.functional``)."""

from __future__ import annotations

from fastpar.ops.cross_entropy import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]
