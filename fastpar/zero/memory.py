"""Bytes per rank under ZeRO, planned (the paper's model or fastpar's real layout) and measured."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank: ``params``, ``grads``, ``optimizer`` (masters included) and ``total``."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def estimate_memory(
    num_params: int | float,
    dp_size: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    mode: str = "paper",
    bucket_numels: list[int] | None = None,
) -> MemoryEstimate:
    """Bytes per rank for ``num_params`` parameters on ``dp_size`` ranks at ZeRO ``stage`` 0-3,
    by the ZeRO paper's model (``mode="paper"``) or fastpar's layout (``mode="fastpar"``, with
    ``bucket_numels``): docs/layouts.md ("Memory planner")."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    n = dp_size
    if mode == "paper":
        psi = float(num_params)
        p, g, k = param_bytes * psi, grad_bytes * psi, optimizer_bytes * psi
        if stage == 0:
            return MemoryEstimate(p, g, k)
        if stage == 1:
            return MemoryEstimate(p, g, k / n)
        if stage == 2:
            return MemoryEstimate(p, g / n, k / n)
        return MemoryEstimate(p / n, g / n, k / n)
    if mode != "fastpar":
        raise ValueError(f"mode must be 'paper' or 'fastpar', got {mode!r}")
    numels = bucket_numels if bucket_numels is not None else [int(num_params)]
    padded = sum(math.ceil(x / n) * n for x in numels)
    shard = padded // n
    k = optimizer_bytes * shard
    if stage == 0:
        return MemoryEstimate(
            param_bytes * sum(numels), grad_bytes * sum(numels), optimizer_bytes * sum(numels)
        )
    if stage == 1:  # fp32 gradients keep their reduced shard inside the full buffer
        extra = 0 if grad_bytes == 4 else 4 * shard
        return MemoryEstimate(param_bytes * padded, grad_bytes * padded + extra, k)
    if stage == 2:
        return MemoryEstimate(param_bytes * padded, 4 * shard, k)
    return MemoryEstimate(param_bytes * shard, 4 * shard, k)


def adamw_state_bytes(state_dtype: torch.dtype = torch.float32, *, master: bool = True) -> int:
    """AdamW's optimizer bytes per parameter element, ``estimate_memory``'s ``optimizer_bytes``:
    exp_avg and exp_avg_sq in ``state_dtype`` (``FusedAdamW(state_dtype=)``), and the fp32
    master when it is kept apart from the parameters (``master``: bf16 / fp16 parameters).
    fp32 state 12 (8 without a master), bf16 state 8 (4). The 0-dim "step" of each optimizer
    tensor (4 bytes per flat) is not counted."""
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
    return (4 if master else 0) + 2 * state_dtype.itemsize


def held_bytes(
    params, optimizer: torch.optim.Optimizer | None = None, masters=()
) -> dict[str, int]:
    """Measured bytes a plain (stage-0) setup holds: parameters, their gradients, fp32 masters,
    optimizer state tensors."""

    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    params = list(params)
    state = []
    if optimizer is not None:
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params),
        "masters": nbytes(m for m in masters if all(m is not p for p in params)),
        "optimizer": nbytes(state),
    }
    out["total"] = sum(out.values())
    return out
