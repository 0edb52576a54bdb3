"""Triton fused AdamW step: the launchers and pointer tables of the kernels in
``fastpar.kernels.adamw_jit``, over a flat shard or many tensors (one launch per dtype group):
docs/kernels.md ("Inside the kernels").
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fastpar.kernels.adamw_jit import _adamw_flat_kernel, _adamw_multi_kernel
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
    return (
        q,
        g.data_ptr(),
        m.data_ptr(),
        v.data_ptr(),
        q if lp is None else lp.data_ptr(),
        step.data_ptr(),
    )


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
        _TABLES,
        key,
        lambda: _build_table(pointers, numels, chunk),
        device,
        "fused AdamW: this parameter set's pointer table",
    )


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
