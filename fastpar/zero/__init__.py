"""ZeRO under its historical names — ``ZeroOptimizer`` (stages 1, 2, around an optimizer) and
``Zero3`` (stage 3, around a module), both ``fastpar.parallel.Shard`` — and the memory planner
(``estimate_memory``: the paper's model or fastpar's layout; ``adamw_state_bytes``: AdamW's K
for fp32 or bf16 moments; ``held_bytes``: measured)."""

from __future__ import annotations

from fastpar.zero.memory import MemoryEstimate, adamw_state_bytes, estimate_memory, held_bytes
from fastpar.zero.optimizer import ZeroOptimizer
from fastpar.zero.zero3 import Zero3

__all__ = [
    "MemoryEstimate",
    "Zero3",
    "ZeroOptimizer",
    "adamw_state_bytes",
    "estimate_memory",
    "held_bytes",
]
