"""Triton kernels of MoE permute / unpermute, and their launchers.

Imported as ``fastpar.kernels.moe_permute``, only when ``fastpar.ops.moe_permute`` dispatches to
Triton. The slots come from ``fastpar.reference.moe_permute.compute_slots`` (torch ops); these
kernels only move rows. Shapes as there: ``slots [T, k]`` int64 (−1 = dropped), permuted buffer
``[R, H]`` with ``R = E·C`` (capacity) or ``T·k`` (dropless). No atomics anywhere: every program
owns the rows it writes, so every result is deterministic.

* ``_scatter_kernel``: one program per token, over ``[BLOCK_K, BLOCK_H]`` tiles of its ``k``
  slots; reads ``src[t]`` once and writes ``w_j · src[t]`` to each kept slot row (``w = 1`` for
  permute, ``probs`` for the backward of unpermute); with ``DOT`` it also forms
  ``⟨src[t], other[slot_j]⟩`` (the gradient of the routing weights). Dropped choices are masked:
  a slot of −1 is never dereferenced, so routing more tokens than fit writes nothing out of
  bounds.
* ``_gather_kernel``: one program per token; ``out[t] = Σ_j w_j · src[slot_j]`` in fp32 (unpermute,
  and the backward of permute with ``w = 1``).
* ``_zero_rows_kernel``: capacity mode only, one program per row ``r = e·C + p``; zeroes the row
  when ``p >= kept_counts[e]`` (kept positions of an expert are exactly ``0 .. kept − 1``), so
  the permuted buffer is written exactly once and never pre-filled.

Row offsets are int64 (``R × H`` may exceed 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE = 4096  # elements of one [BLOCK_K, BLOCK_H] tile at most (bounded registers)
MAX_BLOCK_H = 1024


@triton.jit
def _scatter_kernel(
    src_ptr,
    slots_ptr,
    w_ptr,
    out_ptr,
    other_ptr,
    dot_ptr,
    H,
    K,
    src_stride,
    out_stride,
    other_stride,
    HAS_W: tl.constexpr,
    STORE: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + t * K + j, mask=j < K, other=-1)
    kept = slot >= 0
    rows = tl.where(kept, slot, 0)
    if HAS_W:
        w = tl.load(w_ptr + t * K + j, mask=kept, other=0.0).to(tl.float32)
    else:
        w = tl.where(kept, 1.0, 0.0)
    dot = tl.zeros([BLOCK_K], dtype=tl.float32)
    cols0 = tl.arange(0, BLOCK_H)
    for start in range(0, H, BLOCK_H):
        cols = start + cols0
        in_row = cols < H
        mask = kept[:, None] & in_row[None, :]
        x = tl.load(src_ptr + t * src_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        if STORE:
            y = w[:, None] * x[None, :]
            offs = rows[:, None] * out_stride + cols[None, :]
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        if DOT:
            offs_o = rows[:, None] * other_stride + cols[None, :]
            v = tl.load(other_ptr + offs_o, mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(v * x[None, :], axis=1)
    if DOT:
        tl.store(dot_ptr + t * K + j, dot.to(dot_ptr.dtype.element_ty), mask=j < K)


@triton.jit
def _gather_kernel(
    src_ptr,
    slots_ptr,
    w_ptr,
    out_ptr,
    H,
    K,
    src_stride,
    out_stride,
    HAS_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + t * K + j, mask=j < K, other=-1)
    kept = slot >= 0
    rows = tl.where(kept, slot, 0)
    if HAS_W:
        w = tl.load(w_ptr + t * K + j, mask=kept, other=0.0).to(tl.float32)
    else:
        w = tl.where(kept, 1.0, 0.0)
    cols0 = tl.arange(0, BLOCK_H)
    for start in range(0, H, BLOCK_H):
        cols = start + cols0
        in_row = cols < H
        offs = rows[:, None] * src_stride + cols[None, :]
        v = tl.load(src_ptr + offs, mask=kept[:, None] & in_row[None, :], other=0.0)
        acc = tl.sum(v.to(tl.float32) * w[:, None], axis=0)
        tl.store(out_ptr + t * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _zero_rows_kernel(
    out_ptr,
    kept_ptr,
    C,
    H,
    out_stride,
    BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    e = r // C
    pos = r - e * C
    kept = tl.load(kept_ptr + e)
    if pos >= kept:
        cols0 = tl.arange(0, BLOCK_H)
        zero = tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty)
        for start in range(0, H, BLOCK_H):
            cols = start + cols0
            tl.store(out_ptr + r * out_stride + cols, zero, mask=cols < H)


def _blocks(k: int, h: int, block_h: int | None) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_H): ``BLOCK_K = next_pow2(k)``; ``BLOCK_H`` a power of two, the tile
    ``BLOCK_K × BLOCK_H`` at most ``MAX_TILE`` elements unless ``block_h`` overrides it."""
    bk = triton.next_power_of_2(max(k, 1))
    if block_h is not None:
        if block_h < 1 or block_h & (block_h - 1):
            raise ValueError(f"block_h must be a power of two, got {block_h}")
        return bk, block_h
    cap = max(16, min(MAX_BLOCK_H, MAX_TILE // bk))
    return bk, min(triton.next_power_of_2(max(h, 1)), cap)


def _warps(tile: int) -> int:
    return 8 if tile >= 4096 else 4 if tile >= 512 else 2


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along the hidden dimension (rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _zero_unused(out: torch.Tensor, kept_counts: torch.Tensor, capacity: int, bh: int) -> None:
    rows, h = out.shape
    if rows == 0 or h == 0:
        return
    _zero_rows_kernel[(rows,)](
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
    bk, bh = _blocks(k, h, block_h)
    if capacity is not None:
        _zero_unused(out, kept_counts, capacity, bh)
    if t == 0 or h == 0:
        return out
    _scatter_kernel[(t,)](
        x,
        slots.contiguous(),
        x,  # unused: no weights
        out,
        x,  # unused: no dot
        x,
        h,
        k,
        x.stride(0),
        out.stride(0),
        0,
        HAS_W=False,
        STORE=True,
        DOT=False,
        BLOCK_K=bk,
        BLOCK_H=bh,
        num_warps=_warps(bk * bh),
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
    bk, bh = _blocks(k, h, block_h)
    _gather_kernel[(t,)](
        src,
        slots.contiguous(),
        src if probs is None else probs.contiguous(),
        out,
        h,
        k,
        src.stride(0),
        out.stride(0),
        HAS_W=probs is not None,
        BLOCK_K=bk,
        BLOCK_H=bh,
        num_warps=_warps(bk * bh),
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
    ``⟨grad[t], src[slot]⟩``. ``out`` optionally receives d src."""
    t, k = slots.shape
    h = src.shape[1]
    grad = _rows_view(grad)
    src = _rows_view(src)
    probs = probs.contiguous()
    bk, bh = _blocks(k, h, block_h)
    d_src = d_probs = None
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
    if t == 0 or h == 0 or not (need_src or need_probs):
        return d_src, d_probs
    _scatter_kernel[(t,)](
        grad,
        slots.contiguous(),
        probs,
        grad if d_src is None else d_src,
        src,
        probs if d_probs is None else d_probs,
        h,
        k,
        grad.stride(0),
        0 if d_src is None else d_src.stride(0),
        src.stride(0),
        HAS_W=True,
        STORE=need_src,
        DOT=need_probs,
        BLOCK_K=bk,
        BLOCK_H=bh,
        num_warps=_warps(bk * bh),
    )
    return d_src, d_probs
