"""Triton kernels of the fused AdamW step: one pass per element over a flat shard or many tensors.

Imported as ``fastpar.kernels.adamw``, only when ``fastpar.ops.adamw`` dispatches to Triton. Same
math and order of operations as ``fastpar.reference.adamw`` (torch.optim.AdamW's single-tensor,
non-capturable path), element by element in fp32:

* ``g = (fp32(grad) · inv_scale) · clip_coef`` (negated when maximizing);
* ``p = p · decay``; ``m = fma(w1, g − m, m)`` (torch.lerp; ``fma(w1 − 1, g − m, g)`` when
  ``w1 ≥ 0.5``); ``v = fma(w2 · g, g, v · β2)`` (torch's mul_ + addcmul_);
* ``p = p + (−step_size · m) / (sqrt(v) / bc2_sqrt + eps)`` with IEEE division and square root
  (``div_rn`` / ``sqrt_rn``) and fp-contraction off, so the compiler adds no fma of its own.

Moments may be stored in bf16 (half their memory and traffic): loaded to fp32, updated and used
for ``p`` unrounded, stored rounded to nearest even.

The step-dependent scalars ``step_size = lr / (1 − β1^t)`` and ``bc2_sqrt = sqrt(1 − β2^t)`` are
computed by every program in float64 from the step tensor (loaded by pointer: no host sync) and
rounded once to fp32, as torch does in Python doubles. Triton passes a python float as fp32, so
``lr``, ``β1`` and ``β2`` travel as the int64 bit patterns of their doubles. ``β^t`` is taken by
repeated squaring (fp64 multiplications only, no libdevice).

Skipping: ``found_inf != 0`` (loaded by pointer) shrinks every program's range to nothing, so no
element is loaded or stored. All offsets are int64 (flat shards exceed 2^31 elements).

Flat form: programs over one tensor, ``CHUNK`` consecutive elements each, ``BLOCK`` at a time:
the whole blocks unmasked, then one masked tail block, so aligned data (pointers 16-byte aligned,
which Triton specialises on) is read and written with 128-bit accesses whatever ``numel`` is.
Multi-tensor form: one launch per (grad dtype, low-precision copy dtype, step dtype, aligned)
group; an int64 table built on the host from shapes and data pointers (no device value is read)
holds, per tensor, the pointers of param / grad / exp_avg / exp_avg_sq / copy / step and the
numel, and per program the tensor it works on and its start offset. A group whose tensors all
start on 16-byte boundaries hints its table pointers as such (``ALIGNED``: 128-bit accesses).
Device tables are cached by their pointers and numels (``_device_table``): built and copied
once per parameter set, then reused every step — no host work beyond the lookup, no copy, so a
warmed-up step can be captured in a CUDA graph.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fastpar.kernels.tables import TABLE_CACHE_SIZE, cached_table  # noqa: F401  (the size: for tests)

BLOCK = 1024  # elements per inner step of a program
CHUNK = 8 * BLOCK  # elements per program at most
NUM_WARPS = 4
MAX_PROGRAMS = 1 << 20  # programs per multi-tensor launch at most; longer tables take several

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.int64: tl.int64,
}


@triton.jit
def _f64(bits):
    """The float64 whose bit pattern is the integer ``bits``."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _ipow(base, e):
    """``base ** e`` for a float64 base and an int64 exponent ≥ 0 (repeated squaring)."""
    acc = base * 0.0 + 1.0
    while e > 0:
        acc = tl.where((e & 1) == 1, acc * base, acc)
        base = base * base
        e = e >> 1
    return acc


@triton.jit
def _step_scalars(step_ptr, lr_bits, beta1_bits, beta2_bits):
    """fp32 ``(−lr / (1 − β1^t), sqrt(1 − β2^t))`` computed in float64 from the step tensor."""
    t = tl.load(step_ptr).to(tl.int64)
    bc1 = 1.0 - _ipow(_f64(beta1_bits), t)
    bc2 = 1.0 - _ipow(_f64(beta2_bits), t)
    neg_step_size = (-(_f64(lr_bits) / bc1)).to(tl.float32)
    return neg_step_size, tl.sqrt(bc2).to(tl.float32)


@triton.jit
def _update_block(
    p_ptr, g_ptr, m_ptr, v_ptr, lp_ptr, idx, left, gscale, clip, decay, w1, beta2, w2, eps,
    neg_step_size, bc2_sqrt, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
    HAS_WD: tl.constexpr, HAS_LP: tl.constexpr, LP_DTYPE: tl.constexpr, MAXIMIZE: tl.constexpr,
    SMALL_W1: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One block: elements ``idx`` (int32 lanes) of pointers already advanced to the block's
    start (int64 offsets stay scalar); unmasked (the body) or masked by ``idx < left``."""
    mask = idx < left if MASKED else None
    other = 0.0 if MASKED else None
    g = tl.load(g_ptr + idx, mask=mask, other=other).to(tl.float32)
    p = tl.load(p_ptr + idx, mask=mask, other=other)
    m = tl.load(m_ptr + idx, mask=mask, other=other).to(tl.float32)  # fp32 or bf16 moments
    v = tl.load(v_ptr + idx, mask=mask, other=other).to(tl.float32)
    if HAS_SCALE:
        g = g * gscale
    if HAS_CLIP:
        g = g * clip
    if MAXIMIZE:
        g = -g
    if HAS_WD:
        p = p * decay
    diff = g - m
    # torch.lerp(m, g, w1): m + w1·(g − m) for a small weight, else g − (1 − w1)·(g − m)
    m = tl.fma(diff, w1, m) if SMALL_W1 else tl.fma(diff, w1 - 1.0, g)
    v = tl.fma(w2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    tl.store(p_ptr + idx, p, mask=mask)
    tl.store(m_ptr + idx, m.to(m_ptr.dtype.element_ty), mask=mask)  # p used them unrounded
    tl.store(v_ptr + idx, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_LP:
        tl.store(lp_ptr + idx, p.to(LP_DTYPE), mask=mask)


@triton.jit
def _update_range(
    p_ptr, g_ptr, m_ptr, v_ptr, lp_ptr, start, end, scale_ptr, clip_ptr, decay, w1, beta2, w2,
    eps, neg_step_size, bc2_sqrt, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
    HAS_WD: tl.constexpr, HAS_LP: tl.constexpr, LP_DTYPE: tl.constexpr, MAXIMIZE: tl.constexpr,
    SMALL_W1: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Update elements ``[start, end)`` (int64; ``start`` a multiple of ``CHUNK``): whole
    blocks unmasked (128-bit accesses where the pointers are 16-byte aligned), then one masked
    tail block."""
    gscale = tl.load(scale_ptr) if HAS_SCALE else 1.0
    clip = tl.load(clip_ptr) if HAS_CLIP else 1.0
    lanes = tl.arange(0, BLOCK)
    full = (end - start) // BLOCK
    for i in range(0, full):
        o = start + i * BLOCK
        _update_block(
            p_ptr + o, g_ptr + o, m_ptr + o, v_ptr + o, lp_ptr + o, lanes, BLOCK, gscale, clip,
            decay, w1, beta2, w2, eps, neg_step_size, bc2_sqrt, HAS_SCALE, HAS_CLIP, HAS_WD,
            HAS_LP, LP_DTYPE, MAXIMIZE, SMALL_W1, False,
        )  # fmt: skip
    o = start + full * BLOCK
    if o < end:
        _update_block(
            p_ptr + o, g_ptr + o, m_ptr + o, v_ptr + o, lp_ptr + o, lanes, (end - o).to(tl.int32),
            gscale, clip, decay, w1, beta2, w2, eps, neg_step_size, bc2_sqrt, HAS_SCALE,
            HAS_CLIP, HAS_WD, HAS_LP, LP_DTYPE, MAXIMIZE, SMALL_W1, True,
        )  # fmt: skip


@triton.jit(do_not_specialize=["numel", "lr_bits", "beta1_bits", "beta2_bits"])
def _adamw_flat_kernel(
    p_ptr,  # [N] fp32 master
    g_ptr,  # [N] fp32 / bf16 / fp16
    m_ptr,  # [N] fp32 / bf16
    v_ptr,  # [N] fp32 / bf16
    lp_ptr,  # [N] bf16 / fp16 copy (any pointer when HAS_LP is False)
    step_ptr,  # 0-dim int64 / fp32: t
    scale_ptr,  # 0-dim fp32: 1 / loss scale (unused unless HAS_SCALE)
    clip_ptr,  # 0-dim fp32: clip coefficient (unused unless HAS_CLIP)
    inf_ptr,  # 0-dim fp32: skip flag (unused unless HAS_INF)
    numel,
    lr_bits,
    beta1_bits,
    beta2_bits,
    decay,
    w1,
    beta2,
    w2,
    eps,
    HAS_SCALE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_INF: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_LP: tl.constexpr,
    LP_DTYPE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SMALL_W1: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * CHUNK
    end = tl.minimum(numel.to(tl.int64), start + CHUNK)
    if HAS_INF:
        end = tl.where(tl.load(inf_ptr) != 0, start, end)  # a skipped step touches nothing
    neg_step_size, bc2_sqrt = _step_scalars(step_ptr, lr_bits, beta1_bits, beta2_bits)
    _update_range(
        p_ptr, g_ptr, m_ptr, v_ptr, lp_ptr, start, end, scale_ptr, clip_ptr, decay, w1, beta2,
        w2, eps, neg_step_size, bc2_sqrt, HAS_SCALE, HAS_CLIP, HAS_WD, HAS_LP, LP_DTYPE,
        MAXIMIZE, SMALL_W1, BLOCK,
    )  # fmt: skip


@triton.jit
def _table_ptr(table, row, num_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer ``row`` of tensor ``t`` from the table; ``ALIGNED``: hinted 16-byte aligned
    (every tensor of the launch is, checked by the launcher), which lets the loads go 128-bit."""
    ptr = tl.load(table + row * num_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits"])
def _adamw_multi_kernel(
    table,  # [7, T] int64: param, grad, exp_avg, exp_avg_sq, copy, step pointers; numels
    num_tensors,  # T (row stride of the table)
    block_tensor,  # [P] int64: tensor index of each program
    block_start,  # [P] int64: first element of each program in its tensor
    scale_ptr,
    clip_ptr,
    inf_ptr,
    lr_bits,
    beta1_bits,
    beta2_bits,
    decay,
    w1,
    beta2,
    w2,
    eps,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    STEP_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_INF: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_LP: tl.constexpr,
    LP_DTYPE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SMALL_W1: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    start = tl.multiple_of(tl.load(block_start + pid), CHUNK)  # k·CHUNK by construction
    p_ptr = _table_ptr(table, 0, num_tensors, t, tl.float32, ALIGNED)
    g_ptr = _table_ptr(table, 1, num_tensors, t, G_DTYPE, ALIGNED)
    m_ptr = _table_ptr(table, 2, num_tensors, t, M_DTYPE, ALIGNED)
    v_ptr = _table_ptr(table, 3, num_tensors, t, M_DTYPE, ALIGNED)
    lp_ptr = _table_ptr(table, 4, num_tensors, t, LP_DTYPE, ALIGNED)
    step_ptr = _table_ptr(table, 5, num_tensors, t, STEP_DTYPE, False)
    numel = tl.load(table + 6 * num_tensors + t)
    end = tl.minimum(numel, start + CHUNK)
    if HAS_INF:
        end = tl.where(tl.load(inf_ptr) != 0, start, end)
    neg_step_size, bc2_sqrt = _step_scalars(step_ptr, lr_bits, beta1_bits, beta2_bits)
    _update_range(
        p_ptr, g_ptr, m_ptr, v_ptr, lp_ptr, start, end, scale_ptr, clip_ptr, decay, w1, beta2,
        w2, eps, neg_step_size, bc2_sqrt, HAS_SCALE, HAS_CLIP, HAS_WD, HAS_LP, LP_DTYPE,
        MAXIMIZE, SMALL_W1, BLOCK,
    )  # fmt: skip


def _bits(x: float) -> int:
    """The int64 bit pattern of the float64 ``x``."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _hyper(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool
) -> tuple[dict, dict]:
    """(runtime scalar arguments, constexpr flags) shared by both kernels.

    The fp32 scalars are the python doubles torch rounds to fp32 when it applies them.
    """
    w1 = 1.0 - beta1
    args = dict(
        lr_bits=_bits(lr),
        beta1_bits=_bits(beta1),
        beta2_bits=_bits(beta2),
        decay=1.0 - lr * weight_decay,
        w1=w1,
        beta2=beta2,
        w2=1.0 - beta2,
        eps=eps,
    )
    small = abs(float(torch.tensor(w1, dtype=torch.float32))) < 0.5  # torch.lerp's switch
    flags = dict(HAS_WD=weight_decay != 0, MAXIMIZE=bool(maximize), SMALL_W1=small)
    return args, flags


def _check_blocks(block: int, chunk: int) -> None:
    if block < 1 or block & (block - 1) or chunk < block or chunk % block:
        raise ValueError(f"block ({block}) must be a power of two and chunk ({chunk}) a multiple")


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: torch.Tensor,
    inv_scale: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    param_lp: torch.Tensor | None = None,
    maximize: bool = False,
    block: int = BLOCK,
    chunk: int = CHUNK,
) -> None:
    """Triton version of ``fastpar.reference.adamw.adamw_step_`` (one launch).

    Contiguous tensors of equal numel N on one device: param fp32, exp_avg / exp_avg_sq fp32 or
    both bf16, grad fp32 / bf16 / fp16, param_lp bf16 / fp16 or None. step, inv_scale, clip_coef, found_inf:
    0-dim tensors on that device (validated by ``fastpar.ops.adamw``). ``block`` / ``chunk``
    (a multiple of ``block``) are exposed for tests.
    """
    n = param.numel()
    if n == 0:
        return
    _check_blocks(block, chunk)
    args, flags = _hyper(lr, beta1, beta2, eps, weight_decay, maximize)
    grid = (triton.cdiv(n, chunk),)
    _adamw_flat_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param if param_lp is None else param_lp,
        step,
        param if inv_scale is None else inv_scale,
        param if clip_coef is None else clip_coef,
        param if found_inf is None else found_inf,
        n,
        **args,
        HAS_SCALE=inv_scale is not None,
        HAS_CLIP=clip_coef is not None,
        HAS_INF=found_inf is not None,
        HAS_LP=param_lp is not None,
        LP_DTYPE=_TL_DTYPES[torch.float32 if param_lp is None else param_lp.dtype],
        **flags,
        CHUNK=chunk,
        BLOCK=block,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def _pointers(p, g, m, v, lp, step) -> tuple[int, ...]:
    """The table column of one tensor: param, grad, exp_avg, exp_avg_sq, copy (the param's
    when there is none: never written then) and step data pointers."""
    q = p.data_ptr()
    return (q, g.data_ptr(), m.data_ptr(), v.data_ptr(), q if lp is None else lp.data_ptr(),
            step.data_ptr())  # fmt: skip


def _build_table(
    pointers: Sequence[tuple[int, ...]], numels: Sequence[int], chunk: int
) -> tuple[torch.Tensor, int]:
    """One int64 CPU tensor ``[7·T pointers/numels | P block tensor | P block start]``, and P."""
    numel = torch.tensor(numels, dtype=torch.int64)
    per_tensor = (numel + chunk - 1) // chunk
    tid = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), per_tensor)
    first = torch.cumsum(per_tensor, 0) - per_tensor  # first program of each tensor
    start = (torch.arange(tid.numel(), dtype=torch.int64) - first[tid]) * chunk
    rows = torch.tensor(pointers, dtype=torch.int64).t().reshape(-1)  # [6, T], row-major
    return torch.cat([rows, numel, tid, start]), tid.numel()


_TABLES: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()


def _device_table(
    pointers: Sequence[tuple[int, ...]], numels: Sequence[int], chunk: int, device
) -> tuple[torch.Tensor, int]:
    """(the device table of ``_build_table``, P), built and copied to the device once per set of
    pointers and numels and reused on later steps (``fastpar.kernels.tables``): no host work
    but the lookup and no host-to-device copy, so a launch after the first can be captured in a
    CUDA graph."""
    key = (device, chunk, tuple(pointers), tuple(numels))
    return cached_table(
        _TABLES, key, lambda: _build_table(pointers, numels, chunk), device,
        "fused AdamW: this parameter set's pointer table",
    )  # fmt: skip


def _aligned(pointers: tuple[int, ...]) -> bool:
    """Whether the first five pointers (not the step's) are on 16-byte boundaries (the kernel's
    128-bit path)."""
    p, g, m, v, lp = pointers[:5]
    return (p | g | m | v | lp) % 16 == 0


def adamw_step_multi_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    steps: Sequence[torch.Tensor],
    inv_scale: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    params_lp: Sequence[torch.Tensor | None] | None = None,
    maximize: bool = False,
    block: int = BLOCK,
    chunk: int = CHUNK,
    max_programs: int = MAX_PROGRAMS,
) -> None:
    """Triton version of ``fastpar.reference.adamw.adamw_step_multi_``.

    Lists of contiguous tensors on one device (per index: param fp32, exp_avg / exp_avg_sq fp32
    or bf16, of one shape, grad fp32 / bf16 / fp16, copy bf16 / fp16 or None, a 0-dim int64 /
    fp32 step). One launch per (grad, moment, copy, step dtype, aligned) group (more past
    ``max_programs``).
    """
    _check_blocks(block, chunk)
    lps = [None] * len(params) if params_lp is None else list(params_lp)
    groups: dict[tuple, list[int]] = {}
    pointers: dict[int, tuple[int, ...]] = {}
    for i, (p, g, lp, t) in enumerate(zip(params, grads, lps, steps, strict=True)):
        if p.numel():
            pointers[i] = _pointers(p, g, exp_avgs[i], exp_avg_sqs[i], lp, t)
            lp_dtype = None if lp is None else lp.dtype
            key = (g.dtype, exp_avgs[i].dtype, lp_dtype, t.dtype, _aligned(pointers[i]))
            groups.setdefault(key, []).append(i)
    if not groups:
        return
    device = params[groups[next(iter(groups))][0]].device
    args, flags = _hyper(lr, beta1, beta2, eps, weight_decay, maximize)
    anchor = params[groups[next(iter(groups))][0]]
    for (g_dtype, m_dtype, lp_dtype, step_dtype, aligned), idx in groups.items():
        numels = [params[i].numel() for i in idx]
        table, n_programs = _device_table([pointers[i] for i in idx], numels, chunk, device)
        t = len(idx)
        block_tensor = table[7 * t : 7 * t + n_programs]
        block_start = table[7 * t + n_programs :]
        for lo in range(0, n_programs, max_programs):
            hi = min(lo + max_programs, n_programs)
            _adamw_multi_kernel[(hi - lo,)](
                table,
                t,
                block_tensor[lo:hi],
                block_start[lo:hi],
                anchor if inv_scale is None else inv_scale,
                anchor if clip_coef is None else clip_coef,
                anchor if found_inf is None else found_inf,
                **args,
                G_DTYPE=_TL_DTYPES[g_dtype],
                M_DTYPE=_TL_DTYPES[m_dtype],
                STEP_DTYPE=_TL_DTYPES[step_dtype],
                HAS_SCALE=inv_scale is not None,
                HAS_CLIP=clip_coef is not None,
                HAS_INF=found_inf is not None,
                HAS_LP=lp_dtype is not None,
                LP_DTYPE=_TL_DTYPES[torch.float32 if lp_dtype is None else lp_dtype],
                **flags,
                ALIGNED=aligned,
                CHUNK=chunk,
                BLOCK=block,
                num_warps=NUM_WARPS,
                enable_fp_fusion=False,
            )
