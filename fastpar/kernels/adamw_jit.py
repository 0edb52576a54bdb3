"""The ``@triton.jit`` code of the fused AdamW step (launched by ``fastpar.kernels.adamw``).

Same math and order of operations as ``fastpar.reference.adamw``, element by element in fp32,
with IEEE division and square root; the step's scalars in float64 from the step tensor; a
skipped step touches nothing: docs/kernels.md ("AdamW", "Inside the kernels").
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    lp_ptr,
    idx,
    left,
    gscale,
    clip,
    decay,
    w1,
    beta2,
    w2,
    eps,
    neg_step_size,
    bc2_sqrt,
    HAS_SCALE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_LP: tl.constexpr,
    LP_DTYPE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SMALL_W1: tl.constexpr,
    MASKED: tl.constexpr,
):
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
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    lp_ptr,
    start,
    end,
    scale_ptr,
    clip_ptr,
    decay,
    w1,
    beta2,
    w2,
    eps,
    neg_step_size,
    bc2_sqrt,
    HAS_SCALE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_LP: tl.constexpr,
    LP_DTYPE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SMALL_W1: tl.constexpr,
    BLOCK: tl.constexpr,
):
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
            p_ptr + o,
            g_ptr + o,
            m_ptr + o,
            v_ptr + o,
            lp_ptr + o,
            lanes,
            BLOCK,
            gscale,
            clip,
            decay,
            w1,
            beta2,
            w2,
            eps,
            neg_step_size,
            bc2_sqrt,
            HAS_SCALE,
            HAS_CLIP,
            HAS_WD,
            HAS_LP,
            LP_DTYPE,
            MAXIMIZE,
            SMALL_W1,
            False,
        )
    o = start + full * BLOCK
    if o < end:
        _update_block(
            p_ptr + o,
            g_ptr + o,
            m_ptr + o,
            v_ptr + o,
            lp_ptr + o,
            lanes,
            (end - o).to(tl.int32),
            gscale,
            clip,
            decay,
            w1,
            beta2,
            w2,
            eps,
            neg_step_size,
            bc2_sqrt,
            HAS_SCALE,
            HAS_CLIP,
            HAS_WD,
            HAS_LP,
            LP_DTYPE,
            MAXIMIZE,
            SMALL_W1,
            True,
        )


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
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        lp_ptr,
        start,
        end,
        scale_ptr,
        clip_ptr,
        decay,
        w1,
        beta2,
        w2,
        eps,
        neg_step_size,
        bc2_sqrt,
        HAS_SCALE,
        HAS_CLIP,
        HAS_WD,
        HAS_LP,
        LP_DTYPE,
        MAXIMIZE,
        SMALL_W1,
        BLOCK,
    )


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
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        lp_ptr,
        start,
        end,
        scale_ptr,
        clip_ptr,
        decay,
        w1,
        beta2,
        w2,
        eps,
        neg_step_size,
        bc2_sqrt,
        HAS_SCALE,
        HAS_CLIP,
        HAS_WD,
        HAS_LP,
        LP_DTYPE,
        MAXIMIZE,
        SMALL_W1,
        BLOCK,
    )
