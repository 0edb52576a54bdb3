"""Triton launchers of the chunked (fused) linear cross-entropy.

The matmuls stay in torch (cuBLAS); the vocab-parallel CE's kernels
(``fastpar.kernels.cross_entropy``) work on a chunk's reused ``[chunk, V_local]`` logits buffer,
the gradient in place: docs/kernels.md ("Inside the kernels").
"""

from __future__ import annotations

import torch

from fastpar.kernels.cross_entropy import GRAD_BLOCK, grad_logits, local_stats

__all__ = ["GRAD_BLOCK", "grad_logits_", "local_stats"]


def grad_logits_(
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    log_s: torch.Tensor,
    row_grad: torch.Tensor,
    **options,
) -> torch.Tensor:
    """d loss / d logits written into ``logits`` ``[C, V_local]`` (rows contiguous), returned;
    the contract of ``fastpar.reference.linear_cross_entropy.grad_logits_``. ``row_max``,
    ``log_s``, ``row_grad`` fp32 ``[C]``; ``options``: the keywords of
    ``fastpar.kernels.cross_entropy.grad_logits`` (``block``, a power of two, overrides the
    width)."""
    if logits.numel() and logits.stride(1) != 1:
        raise ValueError("grad_logits_: logits must be contiguous along the vocabulary")
    return grad_logits(logits, target, row_max, log_s, row_grad, in_place=True, **options)
