"""The arithmetic a reduced-precision op computes in: fp32, or float64 for a float64 input.

fastpar's layers accumulate bf16 / fp16 (and fp32) inputs in fp32, as HF and Megatron do. A
float64 input — the exact reference a parity check compares every run against
(``fastpar.tolerance``) — keeps float64 throughout, so that reference is the math itself rather
than fp32 once more.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in ``compute_dtype(x.dtype)`` (no copy when it is already)."""
    return x.to(compute_dtype(x.dtype))
