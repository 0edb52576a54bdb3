"""ZeRO: sharded optimizer state (stage 1), gradients (stage 2), and the memory planner."""

from __future__ import annotations

from fastpar.zero.memory import MemoryEstimate, estimate_memory, held_bytes
from fastpar.zero.optimizer import ZeroOptimizer
from fastpar.zero.zero3 import Zero3

__all__ = ["MemoryEstimate", "Zero3", "ZeroOptimizer", "estimate_memory", "held_bytes"]
