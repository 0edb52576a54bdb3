"""Fused AdamW: unscale, clip, decoupled weight decay, moments and update in one pass, on one flat
shard (``adamw_step_``) or many tensors (``adamw_step_multi_``); no host sync. The math, the
bytes moved and the ``step`` / ``found_inf`` contract: docs/kernels.md ("AdamW")."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from fastpar.ops import backend
from fastpar.reference import adamw as ref

OP = "adamw"
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
LP_DTYPES = (torch.bfloat16, torch.float16)
STEP_DTYPES = (torch.int64, torch.float32)

backend.register_op(
    OP,
    ("triton", "reference"),
    "AdamW with unscale, clip, inf-skip and a low-precision param copy in one pass over shards",
)


def _impl(device_type: str) -> Any:
    """The module that runs the update: Triton kernels or the reference."""
    if backend.select(OP, device_type) == "triton":
        return importlib.import_module("fastpar.kernels.adamw")
    return ref


def _scalar(name: str, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A one-element fp32 tensor on ``device`` as 0-dim (None stays None)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.device != device:
        raise ValueError(
            f"{name} must be a one-element tensor on {device} (a device scalar, no host sync), "
            f"got {t if not isinstance(t, torch.Tensor) else f'{tuple(t.shape)} on {t.device}'}"
        )
    return t.reshape(()).to(torch.float32)


def _step(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.device != device:
        raise ValueError(f"{name} must be a one-element int64/fp32 tensor on {device}, got {t!r}")
    if t.dtype not in STEP_DTYPES:
        raise TypeError(f"{name} is {t.dtype}; keep the step count as int64 or float32")
    return t.reshape(())


def _hyper(lr: Any, beta1: Any, beta2: Any, eps: Any, weight_decay: Any) -> None:
    for name, value in (
        ("lr", lr),
        ("beta1", beta1),
        ("beta2", beta2),
        ("eps", eps),
        ("weight_decay", weight_decay),
    ):
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a python float, not a tensor (pass float({name}))")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got ({beta1}, {beta2})")
    if not (lr >= 0.0 and eps >= 0.0 and weight_decay >= 0.0):
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")


def _options(device: torch.device, lr, beta1, beta2, eps, weight_decay, maximize, *scalars) -> dict:
    """The keyword arguments every implementation takes: the hyper-parameters as python
    numbers, ``scalars`` (inv_scale, clip_coef, found_inf) checked and on ``device``."""
    out = dict(
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        maximize=bool(maximize),
    )
    for name, t in zip(("inv_scale", "clip_coef", "found_inf"), scalars, strict=True):
        out[name] = _scalar(name, t, device)
    return out


def _check_one(
    i: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_lp: torch.Tensor | None,
) -> None:
    n, device = param.numel(), param.device
    if param.dtype != torch.float32:
        raise TypeError(f"param{i} is {param.dtype}; the master must be fp32")
    if exp_avg.dtype not in MOMENT_DTYPES or exp_avg_sq.dtype != exp_avg.dtype:
        raise TypeError(
            f"exp_avg{i} is {exp_avg.dtype} and exp_avg_sq{i} {exp_avg_sq.dtype}; the moments "
            "must both be fp32 or both bf16"
        )
    if grad.dtype not in GRAD_DTYPES:
        raise TypeError(f"grad{i} is {grad.dtype}; expected float32, bfloat16 or float16")
    if param_lp is not None and param_lp.dtype not in LP_DTYPES:
        raise TypeError(f"param_lp{i} is {param_lp.dtype}; expected bfloat16 or float16")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.numel() != n or t.device != device:
            raise ValueError(
                f"{name}{i} has {t.numel()} elements on {t.device}; param{i} has {n} on {device}"
            )
    if param_lp is not None and (param_lp.numel() != n or param_lp.device != device):
        raise ValueError(f"param_lp{i} must have param{i}'s {n} elements on {device}")


def _contiguous(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)


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
) -> None:
    """One fused AdamW update of a flat shard, in place (one kernel launch, no host sync).

    param: [N] fp32 master shard (any shape is accepted and treated as flat), updated in place.
    grad: [N] fp32 / bf16 / fp16, the raw still loss-scaled gradient (not modified).
    exp_avg, exp_avg_sq: [N] fp32, or both bf16 (updated in fp32, stored rounded to nearest),
    updated in place.
    step: 0-dim int64 / fp32 device tensor, the step number *after* this update (1 on the
    first); the caller increments it, only when ``found_inf`` is zero (see docs/kernels.md).
    inv_scale: 0-dim fp32, 1 / loss scale (None: 1). clip_coef: 0-dim fp32,
    ``min(1, max_norm / (norm + eps))`` (None: 1). found_inf: 0-dim fp32 flag; nonzero skips
    the whole update. param_lp: optional [N] bf16 / fp16 tensor set to the new param.
    N may exceed 2^31 (int64 offsets).
    """
    _hyper(lr, beta1, beta2, eps, weight_decay)
    _check_one("", param, grad, exp_avg, exp_avg_sq, param_lp)
    device = param.device
    kwargs = _options(
        device, lr, beta1, beta2, eps, weight_decay, maximize, inv_scale, clip_coef, found_inf
    )
    kwargs.update(step=_step("step", step, device), param_lp=param_lp)
    impl = _impl(device.type)
    if impl is not ref and not _contiguous(param, grad, exp_avg, exp_avg_sq, param_lp):
        impl = ref
    if impl is ref and exp_avg.dtype != torch.float32:
        _ref_low_moments([param], [grad], [exp_avg], [exp_avg_sq], kwargs)
        return
    impl.adamw_step_(param, grad, exp_avg, exp_avg_sq, **kwargs)


def _ref_low_moments(params, grads, exp_avgs, exp_avg_sqs, kwargs: dict) -> None:
    """The reference for bf16 moments: updated in fp32 (``p`` from the unrounded values), then
    stored rounded to nearest even, as the kernels do. A skipped step writes nothing back
    (bf16 -> fp32 -> bf16 is exact)."""
    ms = [m.float() for m in exp_avgs]
    vs = [v.float() for v in exp_avg_sqs]
    kw = dict(kwargs)
    if "step" in kw:  # the flat form
        ref.adamw_step_(params[0], grads[0], ms[0], vs[0], **kw)
    else:
        ref.adamw_step_multi_(params, grads, ms, vs, **kw)
    for low, full in zip([*exp_avgs, *exp_avg_sqs], [*ms, *vs], strict=True):
        low.copy_(full)


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
    steps: torch.Tensor | Sequence[torch.Tensor],
    inv_scale: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    params_lp: Sequence[torch.Tensor | None] | None = None,
    maximize: bool = False,
) -> None:
    """``adamw_step_`` over many tensors on one device: one launch per dtype group on Triton.

    params / exp_avgs / exp_avg_sqs: fp32 tensors of any shapes (moments may be bf16, both of a
    tensor's alike); grads: the same shapes, fp32 /
    bf16 / fp16 (dtypes may be mixed); params_lp: None, or per tensor a bf16 / fp16 copy or None.
    steps: one 0-dim step tensor shared by all, or one per tensor (torch's per-param "step"
    state); same convention as ``adamw_step_``. inv_scale / clip_coef / found_inf apply to
    every tensor. Tensors with no elements are skipped.
    """
    params, grads, exp_avgs, exp_avg_sqs = map(list, (params, grads, exp_avgs, exp_avg_sqs))
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(
            f"got {n} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs and "
            f"{len(exp_avg_sqs)} exp_avg_sqs; pass one of each per parameter"
        )
    if n == 0:
        return
    _hyper(lr, beta1, beta2, eps, weight_decay)
    lps = [None] * n if params_lp is None else list(params_lp)
    steps = [steps] * n if isinstance(steps, torch.Tensor) else list(steps)
    if len(lps) != n or len(steps) != n:
        raise ValueError(f"params_lp ({len(lps)}) and steps ({len(steps)}) need {n} entries")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"params live on several devices {sorted(map(str, devices))}; call once per device"
        )
    device = devices.pop()
    for i in range(n):
        _check_one(f"[{i}]", params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], lps[i])
    steps = [_step(f"steps[{i}]", t, device) for i, t in enumerate(steps)]
    kwargs = _options(
        device, lr, beta1, beta2, eps, weight_decay, maximize, inv_scale, clip_coef, found_inf
    )
    impl = _impl(device.type)
    fast = [
        impl is not ref and _contiguous(p, g, m, v, lp)
        for p, g, m, v, lp in zip(params, grads, exp_avgs, exp_avg_sqs, lps, strict=True)
    ]
    low = [m.dtype != torch.float32 for m in exp_avgs]
    for use_fast, module, use_low in ((True, impl, None), (False, ref, False), (False, ref, True)):
        idx = [i for i in range(n) if fast[i] == use_fast and use_low in (None, low[i])]
        if not idx:
            continue
        lists = [[t[i] for i in idx] for t in (params, grads, exp_avgs, exp_avg_sqs)]
        kw = dict(kwargs, steps=[steps[i] for i in idx], params_lp=[lps[i] for i in idx])
        if use_low:
            _ref_low_moments(*lists, kw)
        else:
            module.adamw_step_multi_(*lists, **kw)
