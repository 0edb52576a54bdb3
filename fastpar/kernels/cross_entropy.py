"""Triton kernels for the vocab-parallel cross-entropy, and their launchers.

No communication here: ``_stats_kernel`` reduces one vocabulary shard to per-row statistics
(the layout of ``fastpar.reference.cross_entropy.local_stats``), ``_grad_kernel`` writes one
shard's gradient (``IN_PLACE``: over the logits): docs/kernels.md ("Inside the kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # columns per chunk of the stats kernel at most (bounded registers)
GRAD_BLOCK = 2048  # columns per program of the gradient kernel at most


@triton.jit
def _stats_kernel(
    logits_ptr,
    target_ptr,
    stats_ptr,
    row_stride,
    vocab_start,
    n_valid,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    total = 0.0
    for start in range(0, n_valid, BLOCK):
        idx = start + cols
        mask = idx < n_valid
        x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    target = tl.load(target_ptr + row)
    local = target - vocab_start
    inside = (target != ignore_index) & (local >= 0) & (local < n_valid)
    xt = tl.load(row_ptr + tl.where(inside, local, 0), mask=inside, other=0.0).to(tl.float32)
    out = stats_ptr + row * 4
    tl.store(out + 0, m)
    tl.store(out + 1, s)
    tl.store(out + 2, xt)
    tl.store(out + 3, total)


@triton.jit
def _grad_kernel(
    logits_ptr,
    grad_ptr,
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
    IN_PLACE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = idx < n_cols
    valid = idx < n_valid
    offs = row * row_stride + idx
    g = tl.load(row_grad_ptr + row)
    if IN_PLACE:  # an ignored row (g = 0) is not read, only zeroed
        valid = idx < tl.where(g != 0.0, n_valid, 0)
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
    out_ptr = logits_ptr if IN_PLACE else grad_ptr
    tl.store(out_ptr + offs, d.to(out_ptr.dtype.element_ty), mask=in_row)


def _block(n_cols: int, block: int | None) -> int:
    if block is not None:
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        return block
    return min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK)


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def local_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """Per-row statistics of one shard, fp32 ``[N, 4]`` (same contract as the reference).

    ``logits`` ``[N, V_local]`` contiguous in rows, ``target`` ``[N]`` int64 global ids;
    ``block`` (a power of two) overrides the chunk width.
    """
    n, n_cols = logits.shape
    stats = torch.empty(n, 4, dtype=torch.float32, device=logits.device)
    if n == 0:
        return stats
    blk = _block(n_cols, block)
    _stats_kernel[(n,)](
        logits,
        target,
        stats,
        logits.stride(0),
        vocab_start,
        max(min(n_valid, n_cols), 0),
        ignore_index,
        BLOCK=blk,
        num_warps=_warps(blk),
    )
    return stats


def grad_logits(
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
    in_place: bool = False,
) -> torch.Tensor:
    """d loss / d logits of one shard, ``[N, V_local]`` in the logits' dtype (same contract as
    ``fastpar.reference.cross_entropy.grad_logits``). ``row_max``, ``log_s`` and ``row_grad`` are
    fp32 ``[N]``; ``block`` (a power of two) overrides the width. ``in_place``: written over
    ``logits`` (rows contiguous), which is returned; rows with ``row_grad == 0`` are not read.
    """
    n, n_cols = logits.shape
    grad = logits if in_place else torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n == 0 or n_cols == 0:
        return grad
    blk = _block(min(n_cols, GRAD_BLOCK), block)
    grid = (n, triton.cdiv(n_cols, blk))
    _grad_kernel[grid](
        logits,
        None if in_place else grad,
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
        IN_PLACE=in_place,
        num_warps=_warps(blk),
    )
    return grad
