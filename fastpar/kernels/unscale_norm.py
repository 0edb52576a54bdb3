"""Triton kernel of the fused gradient pass (unscale + inf/NaN check + sum of squares + max).

Same semantics as ``fastpar.reference.unscale_norm`` (``unscale_stats``; ``WRITE=False``:
``unscaled_stats``). One launch per group of tensors over a pointer table, deterministic
partial sums: docs/kernels.md ("Inside the kernels").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fastpar.kernels.tables import TABLE_CACHE_SIZE, cached_table  # noqa: F401  (the size: for tests)

BLOCK = 2048  # elements per inner step of a program
CHUNK = 16 * BLOCK  # elements per program at most (32768)
NUM_WARPS = 4
MAX_PROGRAMS = 1 << 20  # programs per launch at most; longer tables take several launches

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _step(
    src,
    dst,
    idx,
    end,
    inv,
    acc_sq,
    acc_max,
    acc_nan,
    DST_DTYPE: tl.constexpr,
    NORM: tl.constexpr,
    WRITE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One BLOCK of elements: load, unscale, store (``WRITE``), accumulate the stored values
    (read-only: the fp32 products)."""
    if MASKED:
        mask = idx < end
        x = tl.load(src + idx, mask=mask, other=0.0).to(tl.float32)
        y = (x * inv).to(DST_DTYPE)
        if WRITE:
            tl.store(dst + idx, y, mask=mask)
        v = tl.where(mask, y.to(tl.float32), 0.0)  # 0 in masked lanes, whatever inv is
    else:
        x = tl.load(src + idx).to(tl.float32)
        y = (x * inv).to(DST_DTYPE)
        if WRITE:
            tl.store(dst + idx, y)
        v = y.to(tl.float32)
    if NORM:
        acc_sq += v * v
    acc_max = tl.maximum(acc_max, tl.abs(v))  # inf wins; NaN is tracked separately
    acc_nan = acc_nan | (v != v).to(tl.int32)
    return acc_sq, acc_max, acc_nan


@triton.jit
def _unscale_norm_kernel(
    src_ptrs,  # [T] int64: data pointers of the grads
    dst_ptrs,  # [T] int64: data pointers of the destinations (== src_ptrs in place)
    numels,  # [T] int64
    block_tensor,  # [P] int64: tensor index of each program
    block_start,  # [P] int64: first element of each program in its tensor (multiple of CHUNK)
    inv_ptr,  # 0-dim fp32: 1 / loss scale
    sumsq_ptr,  # [P] fp32: partial sums of squares (one slot per program)
    max_ptr,  # [P] fp32: partial max |y| (NaN if the chunk holds a NaN)
    SRC_DTYPE: tl.constexpr,
    DST_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every src and dst pointer of this launch is 16-byte aligned
    NORM: tl.constexpr,
    WRITE: tl.constexpr,  # False: read-only (DST_DTYPE fp32, dst never written)
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    start = tl.multiple_of(tl.load(block_start + pid), BLOCK)
    n = tl.load(numels + t)
    src = tl.load(src_ptrs + t).to(tl.pointer_type(SRC_DTYPE))
    dst = tl.load(dst_ptrs + t).to(tl.pointer_type(DST_DTYPE))
    if ALIGNED:  # pointers loaded from a table carry no alignment: say it, to get wide loads
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    inv = tl.load(inv_ptr)
    end = tl.minimum(n, start + CHUNK)
    lanes = tl.arange(0, BLOCK)
    acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
    acc_max = tl.zeros([BLOCK], dtype=tl.float32)
    acc_nan = tl.zeros([BLOCK], dtype=tl.int32)
    n_full = ((end - start) // BLOCK).to(tl.int32)  # at most CHUNK // BLOCK
    for i in range(0, n_full):  # full blocks: no mask, so loads and stores can vectorise
        acc_sq, acc_max, acc_nan = _step(
            src,
            dst,
            start + i * BLOCK + lanes,
            end,
            inv,
            acc_sq,
            acc_max,
            acc_nan,
            DST_DTYPE,
            NORM,
            WRITE,
            False,
        )
    acc_sq, acc_max, acc_nan = _step(  # the tail (possibly empty)
        src,
        dst,
        start + n_full * BLOCK + lanes,
        end,
        inv,
        acc_sq,
        acc_max,
        acc_nan,
        DST_DTYPE,
        NORM,
        WRITE,
        True,
    )
    part_max = tl.max(acc_max, axis=0)
    part_max = tl.where(tl.max(acc_nan, axis=0) > 0, float("nan"), part_max)
    tl.store(max_ptr + pid, part_max)
    if NORM:
        tl.store(sumsq_ptr + pid, tl.sum(acc_sq, axis=0))
    else:
        tl.store(sumsq_ptr + pid, 0.0)


Group = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""One launch group as host ints: (source pointers, destination pointers, numels)."""


def _build_table(groups: Sequence[Group], chunk: int) -> tuple[torch.Tensor, list[tuple]]:
    """One int64 CPU table for all groups, and per group (table offset, T, block offset, P).

    Layout per group: ``[src ptrs (T) | dst ptrs (T) | numels (T)]``, then all groups' block
    maps: ``[block tensor (P_total) | block start (P_total)]``.
    """
    parts: list[torch.Tensor] = []
    tids: list[torch.Tensor] = []
    starts: list[torch.Tensor] = []
    layout: list[tuple[int, int, int, int]] = []
    offset = 0
    n_blocks = 0
    for src_ptrs, dst_ptrs, numels in groups:
        t = len(src_ptrs)
        numel = torch.tensor(numels, dtype=torch.int64)
        parts.append(torch.tensor(src_ptrs, dtype=torch.int64))
        parts.append(torch.tensor(dst_ptrs, dtype=torch.int64))
        parts.append(numel)
        per_tensor = (numel + chunk - 1) // chunk
        tid = torch.repeat_interleave(torch.arange(t, dtype=torch.int64), per_tensor)
        first = torch.cumsum(per_tensor, 0) - per_tensor  # first block of each tensor
        starts.append((torch.arange(tid.numel(), dtype=torch.int64) - first[tid]) * chunk)
        tids.append(tid)
        p = tid.numel()
        layout.append((offset, t, n_blocks, p))
        offset += 3 * t
        n_blocks += p
    table = torch.cat([*parts, *tids, *starts])
    return table, layout


_TABLES: OrderedDict[tuple, tuple[torch.Tensor, list[tuple]]] = OrderedDict()


def _device_table(
    groups: Sequence[Group], chunk: int, device: torch.device
) -> tuple[torch.Tensor, list[tuple]]:
    """(the device table of ``_build_table``, its layout), built and copied once per set of
    pointers and numels and reused on later calls (``fastpar.kernels.tables``): no rebuild, no
    pinning, no host-to-device copy, so a call after the first can be captured in a CUDA
    graph."""
    key = (device, chunk, tuple(groups))
    return cached_table(
        _TABLES,
        key,
        lambda: _build_table(groups, chunk),
        device,
        "unscale_norm: these gradients' pointer table",
    )


def _launch(
    grads: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    inv_scale: torch.Tensor,
    norm: bool,
    max_programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass over ``grads``: written into ``outs``, or read-only when ``outs`` is None."""
    device = inv_scale.device
    write = outs is not None
    by_dtype: dict[tuple[torch.dtype, torch.dtype, bool], tuple[list, list, list]] = {}
    for g, o in zip(grads, grads if outs is None else outs, strict=True):
        if g.numel():
            gp, op = g.data_ptr(), o.data_ptr()  # host ints: no sync
            dst_dtype = o.dtype if write else torch.float32
            srcs, dsts, numels = by_dtype.setdefault(
                (g.dtype, dst_dtype, (gp | op) % 16 == 0), ([], [], [])
            )
            srcs.append(gp)
            dsts.append(op)
            numels.append(g.numel())
    zero = torch.zeros((), dtype=torch.float32, device=device)
    if not by_dtype:
        return zero, zero.clone()
    keys = list(by_dtype)
    groups = [tuple(map(tuple, by_dtype[k])) for k in keys]
    table, layout = _device_table(groups, CHUNK, device)
    n_blocks = sum(p for *_, p in layout)
    block_tensor = table[table.numel() - 2 * n_blocks : table.numel() - n_blocks]
    block_start = table[table.numel() - n_blocks :]
    part_sq = torch.empty(n_blocks, dtype=torch.float32, device=device)
    part_max = torch.empty(n_blocks, dtype=torch.float32, device=device)
    for (src_dtype, dst_dtype, aligned), (offset, t, b0, p) in zip(keys, layout, strict=True):
        src_ptrs = table[offset : offset + t]
        dst_ptrs = table[offset + t : offset + 2 * t]
        numels = table[offset + 2 * t : offset + 3 * t]
        for lo in range(b0, b0 + p, max_programs):
            hi = min(lo + max_programs, b0 + p)
            _unscale_norm_kernel[(hi - lo,)](
                src_ptrs,
                dst_ptrs,
                numels,
                block_tensor[lo:hi],
                block_start[lo:hi],
                inv_scale,
                part_sq[lo:hi],
                part_max[lo:hi],
                SRC_DTYPE=_TL_DTYPES[src_dtype],
                DST_DTYPE=_TL_DTYPES[dst_dtype],
                ALIGNED=aligned,
                NORM=norm,
                WRITE=write,
                CHUNK=CHUNK,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
            )
    return part_sq.sum(), part_max.amax()


def unscale_stats(
    grads: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    norm: bool = True,
    *,
    max_programs: int = MAX_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``fastpar.reference.unscale_norm.unscale_stats``.

    grads / outs: contiguous tensors on one device, same shapes pairwise (fp32 / bf16 / fp16;
    an out may be its grad). inv_scale: 0-dim fp32 on that device. Returns (sum of squares,
    max |y|), 0-dim fp32, without reading any device value on the host.
    """
    return _launch(grads, list(outs), inv_scale, norm, max_programs)


def unscaled_stats(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    norm: bool = True,
    *,
    max_programs: int = MAX_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``fastpar.reference.unscale_norm.unscaled_stats`` (read-only).

    grads: contiguous tensors on one device (fp32 / bf16 / fp16), not written. Returns (sum of
    squares, max |g · inv_scale|) of the fp32 products, 0-dim fp32, with no host sync.
    """
    return _launch(grads, None, inv_scale, norm, max_programs)
