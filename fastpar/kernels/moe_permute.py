"""Triton kernels of MoE permute / unpermute, and their launchers.

The slots come from ``fastpar.reference.moe_permute.compute_slots``; these kernels only move
rows, deterministically (no atomics): docs/kernels.md ("Inside the kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_H = 1024  # hidden columns a program handles (8 per thread at 4 warps)


@triton.jit
def _scatter_kernel(
    src_ptr,
    slots_ptr,
    w_ptr,
    out_ptr,
    other_ptr,
    dot_ptr,
    H,
    src_stride,
    out_stride,
    other_stride,
    K: tl.constexpr,
    HAS_W: tl.constexpr,
    STORE: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    x = tl.load(src_ptr + t * src_stride + cols, mask=in_row, other=0.0)
    xf = x.to(tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(slots_ptr + t * K + j)
        d = 0.0
        if slot >= 0:
            if STORE:
                if HAS_W:
                    w = tl.load(w_ptr + t * K + j).to(tl.float32)
                    y = (w * xf).to(out_ptr.dtype.element_ty)
                else:
                    y = x.to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + slot * out_stride + cols, y, mask=in_row)
            if DOT:
                v = tl.load(other_ptr + slot * other_stride + cols, mask=in_row, other=0.0)
                d = tl.sum(v.to(tl.float32) * xf, axis=0)
        if DOT:
            # [T·K, blocks]: this block's share of the dot (blocks summed by the launcher)
            tl.store(dot_ptr + (t * K + j) * tl.num_programs(1) + b, d.to(dot_ptr.dtype.element_ty))


@triton.jit
def _gather_kernel(
    src_ptr,
    slots_ptr,
    w_ptr,
    out_ptr,
    H,
    src_stride,
    out_stride,
    K: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(slots_ptr + t * K + j)
        if slot >= 0:
            v = tl.load(src_ptr + slot * src_stride + cols, mask=in_row, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += v
    tl.store(out_ptr + t * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _zero_rows_kernel(out_ptr, kept_ptr, C, H, out_stride, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    e = r // C
    pos = r - e * C
    kept = tl.load(kept_ptr + e)
    if pos >= kept:
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        zero = tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + r * out_stride + cols, zero, mask=cols < H)


def _block_h(h: int, block_h: int | None) -> int:
    """``BLOCK_H``: the next power of two of ``h`` up to ``MAX_BLOCK_H`` (independent of ``k``),
    unless ``block_h`` (a power of two) overrides it."""
    if block_h is not None:
        if block_h < 1 or block_h & (block_h - 1):
            raise ValueError(f"block_h must be a power of two, got {block_h}")
        return block_h
    return min(triton.next_power_of_2(max(h, 1)), MAX_BLOCK_H)


def _warps(block_h: int) -> int:
    """Warps for a ``[block_h]`` program: 8 contiguous elements a thread at full size (one
    128-bit access for 16-bit types, two for fp32), fewer warps for short rows."""
    return max(1, min(4, block_h // 256))


def _grid(rows: int, h: int, bh: int) -> tuple[int, int]:
    return (rows, triton.cdiv(h, bh))


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along the hidden dimension (rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _zero_unused(out: torch.Tensor, kept_counts: torch.Tensor, capacity: int, bh: int) -> None:
    rows, h = out.shape
    if rows == 0 or h == 0:
        return
    _zero_rows_kernel[_grid(rows, h, bh)](
        out, kept_counts.contiguous(), capacity, h, out.stride(0), BLOCK_H=bh, num_warps=_warps(bh)
    )


def permute(
    x: torch.Tensor,
    slots: torch.Tensor,
    kept_counts: torch.Tensor,
    capacity: int | None,
    num_rows: int,
    *,
    block_h: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of ``x [T, H]`` copied to their slots: ``[R, H]`` in ``x``'s dtype, zero where unused
    (same contract as ``fastpar.reference.moe_permute.permute``).

    ``slots [T, k]`` int64; ``kept_counts [E]`` int64 and ``capacity`` locate the unused rows in
    capacity mode (dropless has none). ``out`` (``[R, H]``, rows with unit stride) receives the
    result when given; ``block_h`` (a power of two) overrides the hidden block.
    """
    t, k = slots.shape
    h = x.shape[1]
    x = _rows_view(x)
    if out is None:
        out = torch.empty(num_rows, h, dtype=x.dtype, device=x.device)
    bh = _block_h(h, block_h)
    if capacity is not None:
        _zero_unused(out, kept_counts, capacity, bh)
    if t == 0 or h == 0:
        return out
    _scatter_kernel[_grid(t, h, bh)](
        x,
        slots.contiguous(),
        x,  # unused: no weights
        out,
        x,  # unused: no dot
        x,
        h,
        x.stride(0),
        out.stride(0),
        0,
        K=k,
        HAS_W=False,
        STORE=True,
        DOT=False,
        BLOCK_H=bh,
        num_warps=_warps(bh),
    )
    return out


def unpermute(
    src: torch.Tensor,
    slots: torch.Tensor,
    probs: torch.Tensor | None,
    *,
    block_h: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = Σ_j probs[t, j] · src[slots[t, j]]`` over kept choices, fp32 accumulation:
    ``[T, H]`` in src's dtype (same contract as the reference). ``probs [T, k]`` any float dtype,
    or None for weight 1 (the backward of permute)."""
    t, k = slots.shape
    h = src.shape[1]
    src = _rows_view(src)
    if out is None:
        out = torch.empty(t, h, dtype=src.dtype, device=src.device)
    if t == 0 or h == 0:
        return out
    bh = _block_h(h, block_h)
    _gather_kernel[_grid(t, h, bh)](
        src,
        slots.contiguous(),
        src if probs is None else probs.contiguous(),
        out,
        h,
        src.stride(0),
        out.stride(0),
        K=k,
        HAS_W=probs is not None,
        BLOCK_H=bh,
        num_warps=_warps(bh),
    )
    return out


def unpermute_backward(
    grad: torch.Tensor,
    src: torch.Tensor,
    slots: torch.Tensor,
    probs: torch.Tensor,
    kept_counts: torch.Tensor,
    capacity: int | None,
    need_src: bool = True,
    need_probs: bool = True,
    *,
    block_h: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of unpermute for ``grad [T, H]``: (d src ``[R, H]`` in src's dtype, 0 on unused
    rows; d probs ``[T, k]`` in probs' dtype, 0 for dropped choices). One pass: each token's
    program reads ``grad[t]`` once, writes ``probs[t, j] · grad[t]`` to its kept slots and forms
    ``⟨grad[t], src[slot]⟩`` (per hidden block; the blocks' shares are then summed in a fixed
    order, so the result is deterministic). ``out`` optionally receives d src."""
    t, k = slots.shape
    h = src.shape[1]
    grad = _rows_view(grad)
    src = _rows_view(src)
    probs = probs.contiguous()
    bh = _block_h(h, block_h)
    blocks = triton.cdiv(h, bh)
    d_src = d_probs = dots = None
    if need_src:
        d_src = (
            out if out is not None else torch.empty_like(src, memory_format=torch.contiguous_format)
        )
        if capacity is not None:
            _zero_unused(d_src, kept_counts, capacity, bh)
    if need_probs:
        d_probs = torch.empty(t, k, dtype=probs.dtype, device=probs.device)
        if h == 0:
            d_probs.zero_()
        # one block: the kernel writes d probs itself; more: fp32 shares [T·k, blocks], summed
        dots = d_probs if blocks <= 1 else torch.empty(t * k, blocks, device=probs.device)
    if t == 0 or h == 0 or not (need_src or need_probs):
        return d_src, d_probs
    _scatter_kernel[_grid(t, h, bh)](
        grad,
        slots.contiguous(),
        probs,
        grad if d_src is None else d_src,
        src,
        probs if dots is None else dots,
        h,
        grad.stride(0),
        0 if d_src is None else d_src.stride(0),
        src.stride(0),
        K=k,
        HAS_W=True,
        STORE=need_src,
        DOT=need_probs,
        BLOCK_H=bh,
        num_warps=_warps(bh),
    )
    if need_probs and blocks > 1:
        d_probs.copy_(dots.sum(dim=1).view(t, k))
    return d_src, d_probs
