"""Triton launchers of the chunked (fused) linear cross-entropy.

Imported as ``fastpar.kernels.linear_cross_entropy``, only when
``fastpar.ops.linear_cross_entropy`` dispatches to Triton. The matmuls stay in torch (cuBLAS);
a chunk's logits exist in one reused ``[chunk, V_local]`` buffer and the vocab-parallel CE's
kernels (``fastpar.kernels.cross_entropy``) work on it:

* ``local_stats``: the statistics kernel, per-row (max, sum of exp(x - max), target logit, sum
  of logits), fp32 ``[C, 4]``.
* ``grad_logits_``: the gradient kernel in place (``IN_PLACE``): one program per (row, block of
  ``BLOCK`` columns) overwrites the logits with ``g·(p·(1 + 2z·lse) − (1−α)·onehot − α/V)``,
  ``p = exp(x − M − log S)``, formed in fp32 (the true-class term included) and cast once to
  the buffer's dtype; 0 on padding columns. Rows with ``g == 0`` (ignored targets) are not
  read, only zeroed. Every element is read and written by the same program, so in place is
  safe. Row offsets are int64.
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
