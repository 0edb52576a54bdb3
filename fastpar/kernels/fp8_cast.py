"""Triton kernels of fp8 scaling: amax per scaling group, and the fused scale + clamp + cast that
writes the fp8 tensor and, on request, its transposed copy in the same pass.

Same semantics as ``fastpar.reference.fp8`` (``amax``, ``cast``); the op
(``fastpar.ops.fp8.quantize``) computes the scales between the two launches with the
reference's own torch code. Both kernels are memory-bound; per element of a bf16 input they
move: amax 2 B read (+ 1/32 B of fp32 partial maxima); cast 2 B read + 1 B written (+ 1 B for
the transposed copy): 5-6 B, where 3-4 B are compulsory (x read once). An 8192 x 8192 bf16
operand: 336-403 MB, about 0.10-0.12 ms at 3.35 TB/s (H100). Tiles of 128 x 128 give 8 bf16
(16 B) per thread per load and 16 fp8 bytes per store: the PTX has 128-bit accesses (tested on
CPU by compiling for sm_90). Expected: about 85 % of HBM bandwidth in bytes moved, so about
51-57 % counted in compulsory bytes; not yet measured on a GPU. Offsets are int64 (an operand may
exceed 2^31 elements).
docs/kernels.md ("fp8 scaling") says what the interpreter gets wrong in the fp8 cast and what
a GPU must still check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 128  # rows and columns of a program's tile (the block of the blockwise recipe)
NUM_WARPS = 8
GRANULARITY_CODE = {"tensor": 0, "row": 1, "1x128": 2, "128x128": 3}

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e5m2: tl.float8e5,
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _amax_kernel(
    x_ptr,  # [R, C], row stride stride_r, unit column stride
    tile_ptr,  # [R/TILE, C/TILE] fp32: max |x| of each tile        (TILES)
    row_ptr,  # [R, C/TILE] fp32: max |x| of each row within a tile  (ROWS)
    col_ptr,  # [R/TILE, C] fp32: max |x| of each column in a tile   (COLS)
    R,
    C,
    stride_r,
    TILES: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """One tile: its maxima of |x| (NaN where a NaN is), in fp32 (exact for any input dtype)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    n_ct = tl.num_programs(1)
    rows = i.to(tl.int64) * BR + tl.arange(0, BR)
    cols = j.to(tl.int64) * BC + tl.arange(0, BC)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    a = tl.abs(x.to(tl.float32))
    nan = (a != a).to(tl.int32)
    if TILES:
        m = tl.max(tl.max(a, axis=1), axis=0)
        m = tl.where(tl.max(tl.max(nan, axis=1), axis=0) > 0, float("nan"), m)
        tl.store(tile_ptr + i.to(tl.int64) * n_ct + j, m)
    if ROWS:
        m = tl.where(tl.max(nan, axis=1) > 0, float("nan"), tl.max(a, axis=1))
        tl.store(row_ptr + rows * n_ct + j, m, mask=rows < R)
    if COLS:
        m = tl.where(tl.max(nan, axis=0) > 0, float("nan"), tl.max(a, axis=0))
        tl.store(col_ptr + i.to(tl.int64) * C + cols, m, mask=cols < C)


@triton.jit
def _cast_kernel(
    x_ptr,  # [R, C], row stride stride_r, unit column stride
    scale_ptr,  # scales of x, contiguous: [] | [R, 1] | [R, C/TILE] | [R/TILE, C/TILE]
    scale_t_ptr,  # scales of the transposed copy: row: [C, 1]; 1x128: [C, R/TILE]
    out_ptr,  # [R, C] contiguous, OUT_DTYPE
    out_t_ptr,  # [C, R] contiguous, OUT_DTYPE (TRANSPOSE)
    R,
    C,
    stride_r,
    MAXV: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    GRAN: tl.constexpr,  # 0 tensor, 1 row, 2 1x128, 3 128x128
    TRANSPOSE: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """One tile: ``clamp(fp32(x) · scale, -MAXV, MAXV)`` rounded to OUT_DTYPE (fp32: the value
    before the cast), written to out and, with TRANSPOSE, to out_t with the copy's scales."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i.to(tl.int64) * BR + tl.arange(0, BR)
    cols = j.to(tl.int64) * BC + tl.arange(0, BC)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if GRAN == 0:
        s = tl.load(scale_ptr)
    elif GRAN == 1:
        s = tl.load(scale_ptr + rows, mask=rmask, other=1.0)[:, None]
    elif GRAN == 2:  # BC == TILE: this tile's columns are one block
        s = tl.load(scale_ptr + rows * tl.num_programs(1) + j, mask=rmask, other=1.0)[:, None]
    else:  # BR == BC == TILE: one scale for the tile
        s = tl.load(scale_ptr + i.to(tl.int64) * tl.num_programs(1) + j)
    y = tl.clamp(x * s, -MAXV, MAXV, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], y.to(OUT_DTYPE), mask=mask)
    if TRANSPOSE:
        if GRAN == 1:  # the copy's rows are x's columns: their own scales
            st = tl.load(scale_t_ptr + cols, mask=cmask, other=1.0)[None, :]
            y = tl.clamp(x * st, -MAXV, MAXV, propagate_nan=tl.PropagateNan.ALL)
        elif GRAN == 2:  # BR == TILE: this tile's rows are one block of the copy
            st = tl.load(scale_t_ptr + cols * tl.num_programs(0) + i, mask=cmask, other=1.0)
            y = tl.clamp(x * st[None, :], -MAXV, MAXV, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_t_ptr + cols[None, :] * R + rows[:, None], y.to(OUT_DTYPE), mask=mask)


def _grid(x: torch.Tensor) -> tuple[int, int]:
    r, c = x.shape
    return triton.cdiv(r, TILE), triton.cdiv(c, TILE)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"fp8 kernels take a 2-D tensor with unit column stride, got shape "
            f"{tuple(x.shape)} strides {x.stride()}; pass x.contiguous()"
        )


def amax(
    x: torch.Tensor, granularity: str, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of ``fastpar.reference.fp8.amax`` (in fp32: x's values exactly), and with
    ``transpose`` the amax of ``x.t()`` at the same granularity (row: x's column maxima
    ``[C, 1]``; 1x128: ``[C, R/128]``; tensor and 128x128: None, the same values serve).

    x: ``[R, C]`` fp32 / bf16 / fp16 with unit column stride, dims as the recipe requires. One
    launch; a final ``amax`` over the per-tile partials (no atomics, no host sync).
    """
    _check(x)
    r, c = x.shape
    gr, gc = _grid(x)
    code = GRANULARITY_CODE[granularity]
    tiles = code in (0, 3)
    rows = code in (1, 2)
    cols = transpose and code in (1, 2)
    dev = x.device
    tile_buf = torch.empty((gr, gc) if tiles else (1,), dtype=torch.float32, device=dev)
    row_buf = torch.empty((r, gc) if rows else (1,), dtype=torch.float32, device=dev)
    col_buf = torch.empty((gr, c) if cols else (1,), dtype=torch.float32, device=dev)
    _amax_kernel[(gr, gc)](
        x,
        tile_buf,
        row_buf,
        col_buf,
        r,
        c,
        x.stride(0),
        TILES=tiles,
        ROWS=rows,
        COLS=cols,
        BR=TILE,
        BC=TILE,
        num_warps=NUM_WARPS,
    )
    if code == 0:
        return tile_buf.amax(), None
    if code == 3:
        return tile_buf, None
    if code == 1:
        out = row_buf.amax(dim=1, keepdim=True)
        return out, col_buf.amax(dim=0).unsqueeze(1) if cols else None
    return row_buf, col_buf.t().contiguous() if cols else None  # 1x128: a tile is one block


def cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    *,
    transpose: bool = False,
    scale_t: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of ``fastpar.reference.fp8.cast``: (x8 ``[R, C]``, x8_t ``[C, R]`` or None).

    scale: fp32 in the granularity's shape (contiguous); ``scale_t``: the transposed copy's
    scales for row (``[C, 1]``) and 1x128 (``[C, R/128]``) granularity (tensor and 128x128
    reuse ``scale``). ``out_dtype`` (default ``dtype``) torch.float32 writes the clamped scaled
    values before the cast (what the tests compare under the interpreter). One launch.
    """
    _check(x)
    r, c = x.shape
    code = GRANULARITY_CODE[granularity]
    if transpose and code in (1, 2) and scale_t is None:
        raise ValueError(f"cast: {granularity} scaling's transposed copy needs scale_t")
    out_dtype = dtype if out_dtype is None else out_dtype
    out = torch.empty((r, c), dtype=out_dtype, device=x.device)
    out_t = torch.empty((c, r), dtype=out_dtype, device=x.device) if transpose else None
    scale = scale.to(torch.float32).contiguous()
    st = scale if scale_t is None else scale_t.to(torch.float32).contiguous()
    _cast_kernel[_grid(x)](
        x,
        scale,
        st,
        out,
        out if out_t is None else out_t,
        r,
        c,
        x.stride(0),
        MAXV=_FP8_MAX[dtype],
        OUT_DTYPE=_TL_DTYPES[out_dtype],
        GRAN=code,
        TRANSPOSE=transpose,
        BR=TILE,
        BC=TILE,
        num_warps=NUM_WARPS,
    )
    return out, out_t
