"""Triton kernels of the chunked (fused) linear cross-entropy, and their launchers.

Imported as ``fastpar.kernels.linear_cross_entropy``, only when
``fastpar.ops.linear_cross_entropy`` dispatches to Triton. The matmuls stay in torch (cuBLAS);
a chunk's logits exist in one reused ``[chunk, V_local]`` buffer and these kernels work on it:

* ``local_stats``: the vocab-parallel CE's statistics kernel (``fastpar.kernels.cross_entropy``),
  per-row (max, sum of exp(x - max), target logit, sum of logits), fp32 ``[C, 4]``.
* ``_grad_inplace_kernel``: one program per (row, block of ``BLOCK`` columns); overwrites the
  logits with ``g·(p·(1 + 2z·lse) − (1−α)·onehot − α/V)``, ``p = exp(x − M − log S)``, formed in
  fp32 (the true-class term included) and cast once to the buffer's dtype; 0 on padding columns.
  Rows with ``g == 0`` (ignored targets) are not read, only zeroed. Every element is read and
  written by the same program, so in place is safe. Row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastpar.kernels.cross_entropy import local_stats

__all__ = ["GRAD_BLOCK", "grad_logits_", "local_stats"]

GRAD_BLOCK = 2048  # columns per program at most


@triton.jit
def _grad_inplace_kernel(
    logits_ptr,
    target_ptr,
    max_ptr,
    log_s_ptr,
    row_grad_ptr,
    row_stride,
    n_cols,
    vocab_start,
    n_valid,
    ignore_index,
    one_minus_alpha,
    alpha_over_v,
    two_z,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = idx < n_cols
    offs = row * row_stride + idx
    g = tl.load(row_grad_ptr + row)
    valid = idx < tl.where(g != 0.0, n_valid, 0)  # an ignored row (g = 0) is not read
    row_max = tl.load(max_ptr + row)
    log_s = tl.load(log_s_ptr + row)
    target = tl.load(target_ptr + row)
    local = tl.where(target != ignore_index, target - vocab_start, -1)
    x = tl.load(logits_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    p = tl.exp(x - row_max - log_s)
    d = (
        p * (1.0 + two_z * (row_max + log_s))
        - alpha_over_v
        - tl.where(idx == local, one_minus_alpha, 0.0)
    )
    d = tl.where(valid, d * g, 0.0)
    tl.store(logits_ptr + offs, d.to(logits_ptr.dtype.element_ty), mask=in_row)


def _block(n_cols: int, block: int | None) -> int:
    if block is not None:
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        return block
    return min(triton.next_power_of_2(max(n_cols, 1)), GRAD_BLOCK)


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def grad_logits_(
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    log_s: torch.Tensor,
    row_grad: torch.Tensor,
    *,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    vocab_size: int,
    block: int | None = None,
) -> torch.Tensor:
    """d loss / d logits written into ``logits`` ``[C, V_local]`` (rows contiguous), returned;
    the contract of ``fastpar.reference.linear_cross_entropy.grad_logits_``. ``row_max``,
    ``log_s``, ``row_grad`` fp32 ``[C]``; ``block`` (a power of two) overrides the width."""
    n, n_cols = logits.shape
    if n == 0 or n_cols == 0:
        return logits
    if logits.stride(1) != 1:
        raise ValueError("grad_logits_: logits must be contiguous along the vocabulary")
    blk = _block(n_cols, block)
    grid = (n, triton.cdiv(n_cols, blk))
    _grad_inplace_kernel[grid](
        logits,
        target,
        row_max.contiguous(),
        log_s.contiguous(),
        row_grad.float().contiguous(),
        logits.stride(0),
        n_cols,
        vocab_start,
        max(min(n_valid, n_cols), 0),
        ignore_index,
        1.0 - label_smoothing,
        label_smoothing / vocab_size,
        2.0 * z_loss,
        BLOCK=blk,
        num_warps=_warps(blk),
    )
    return logits
