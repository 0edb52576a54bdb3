"""One fused pass over the gradients: unscale, inf/NaN check, sum of squares and max
(``unscale_and_norm``), its read-only form (``norm_and_inf``) and the clip helpers; no host
sync. Semantics: docs/kernels.md ("Unscale + inf check + norm")."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from fastpar.ops import backend
from fastpar.reference import unscale_norm as ref

OP = "unscale_norm"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

backend.register_op(
    OP,
    ("triton", "reference"),
    "grads *= 1/scale (or read-only), inf/NaN flag, sum of squares and max |g| in one "
    "multi-tensor pass",
)

clip_coefficient = ref.clip_coefficient


def _impl(device_type: str) -> Any:
    """The module that runs the pass: Triton kernels or the reference."""
    if backend.select(OP, device_type) == "triton":
        return importlib.import_module("fastpar.kernels.unscale_norm")
    return ref


def _device(grads: Sequence[torch.Tensor], *extra: Any) -> torch.device:
    """The single device of ``grads`` (else of the first tensor in ``extra``; else CPU)."""
    devices = {g.device for g in grads}
    if len(devices) > 1:
        raise ValueError(
            f"unscale_and_norm: grads live on several devices {sorted(map(str, devices))}; "
            "call it once per device"
        )
    if devices:
        return devices.pop()
    return next((e.device for e in extra if isinstance(e, torch.Tensor)), torch.device("cpu"))


def _check(grads: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None) -> None:
    for i, g in enumerate(grads):
        if g.dtype not in FLOAT_DTYPES:
            raise TypeError(f"grads[{i}] is {g.dtype}; expected float32, bfloat16 or float16")
    if out is None:
        return
    if len(out) != len(grads):
        raise ValueError(f"out has {len(out)} tensors for {len(grads)} grads; pass one per grad")
    for i, (g, o) in enumerate(zip(grads, out, strict=True)):
        if o.shape != g.shape or o.device != g.device or o.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"out[{i}] is {o.dtype} {tuple(o.shape)} on {o.device}; it must be a float "
                f"tensor (normally fp32) of grads[{i}]'s shape {tuple(g.shape)} on {g.device}"
            )


def _as_inv_scale(inv_scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """0-dim fp32 on ``device`` (a python float is rounded to fp32)."""
    if isinstance(inv_scale, torch.Tensor):
        if inv_scale.numel() != 1:
            raise ValueError(f"inv_scale must hold one value, got shape {tuple(inv_scale.shape)}")
        return inv_scale.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(inv_scale), dtype=torch.float32, device=device)


def unscale_and_norm(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor | float,
    *,
    out: Sequence[torch.Tensor] | None = None,
    found_inf: torch.Tensor | None = None,
    norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unscale the gradients and return (found_inf, sum of squares, max |g|) in one pass.

    grads: tensors of any shape (fp32 / bf16 / fp16, mixed, empty allowed) on one device.
    inv_scale: ``1 / loss_scale`` as a 0-dim fp32 tensor or a python float. With ``out=None``
    the grads are unscaled in place (computed in fp32, stored in their dtype); otherwise
    ``out[i]`` (same shape, normally fp32 "main" grads) receives ``grads[i] · inv_scale`` and
    the grads are untouched.

    Returns three 0-dim fp32 tensors on the grads' device: found_inf (1.0 if any unscaled
    value is inf or NaN, else 0.0; one passed in is raised in place to ``max(found_inf, flag)``
    and returned), the sum of squares of the unscaled values (0 when ``norm`` is False) and
    their max |value|, NaN / inf as docs/kernels.md says. No host synchronisation; an empty
    ``grads`` gives zeros (and leaves ``found_inf`` as is).
    """
    grads = list(grads)
    outs = grads if out is None else list(out)
    _check(grads, None if out is None else outs)
    device = _device(grads, inv_scale, found_inf)
    _found_inf(found_inf, device)
    inv = _as_inv_scale(inv_scale, device)
    sumsq, amax = _stats(_impl(device.type), "unscale_stats", [grads, outs], inv, norm)
    return _flag(amax, found_inf), sumsq, amax


def _stats(impl, name: str, lists: list[list[torch.Tensor]], inv: torch.Tensor, norm: bool):
    """(sum of squares, max) of ``impl``'s pass ``name`` over ``lists`` (a gradient and its
    output, or the gradient alone): the kernels take the contiguous ones, the reference the
    others, combined on the device."""
    if impl is ref:
        return getattr(ref, name)(*lists, inv, norm)
    fast = [all(t.is_contiguous() for t in ts) for ts in zip(*lists, strict=True)]

    def part(keep: bool) -> list[list[torch.Tensor]]:
        return [[t for t, f in zip(ts, fast, strict=True) if f == keep] for ts in lists]

    sumsq, amax = getattr(impl, name)(*part(True), inv, norm)
    if not all(fast):
        slow_sq, slow_max = getattr(ref, name)(*part(False), inv, norm)
        sumsq = sumsq + slow_sq
        amax = torch.maximum(amax, slow_max)
    return sumsq, amax


def _found_inf(found_inf: torch.Tensor | None, device: torch.device) -> None:
    if found_inf is not None and (found_inf.device != device or found_inf.numel() != 1):
        raise ValueError(
            f"found_inf must be a one-element tensor on {device}, got shape "
            f"{tuple(found_inf.shape)} on {found_inf.device}"
        )


def _flag(amax: torch.Tensor, found_inf: torch.Tensor | None) -> torch.Tensor:
    flag = ref.found_inf_from_max(amax)
    if found_inf is not None:
        found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.dtype).reshape_as(found_inf)))
        flag = found_inf
    return flag


def norm_and_inf(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor | float,
    *,
    found_inf: torch.Tensor | None = None,
    norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read-only: (found_inf, sum of squares, max |g|) of the unscaled gradients, nothing written.

    grads: tensors of any shape (fp32 / bf16 / fp16, mixed, empty allowed) on one device, not
    modified. inv_scale: ``1 / loss_scale`` (0-dim fp32 tensor or python float). Each value is
    ``y = fp32(g) · inv_scale`` (one fp32 product, never stored); the results are exactly those
    of ``unscale_and_norm(grads, inv_scale, out=<fp32 tensors>)``: found_inf 1.0 if any ``y`` is
    inf or NaN (a ``found_inf`` passed in is raised in place, never reset), the fp32 sum of
    ``y²`` (0 when ``norm`` is False) and ``max |y|``. No host synchronisation.
    """
    grads = list(grads)
    _check(grads, None)
    device = _device(grads, inv_scale, found_inf)
    _found_inf(found_inf, device)
    inv = _as_inv_scale(inv_scale, device)
    sumsq, amax = _stats(_impl(device.type), "unscaled_stats", [grads], inv, norm)
    return _flag(amax, found_inf), sumsq, amax


def scale_(tensors: Sequence[torch.Tensor], coef: torch.Tensor | float) -> None:
    """Multiply every tensor in place by ``coef`` (0-dim tensor or float), computed in fp32.

    Typical use: ``scale_(grads, clip_coefficient(sumsq.sqrt(), max_norm))``; no host sync.
    """
    tensors = list(tensors)
    if not isinstance(coef, torch.Tensor):
        coef = torch.tensor(float(coef), dtype=torch.float32)
    ref.scale_(tensors, coef)
