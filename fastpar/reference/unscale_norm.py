"""Pure-torch reference of the fused gradient pass: unscale, inf/NaN check, sum of squares, max;
the CPU path of ``fastpar.ops.unscale_norm`` and the oracle of its kernel. Statistics are taken
over the values as stored (docs/kernels.md, "Unscale + inf check + norm")."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def unscale_stats(
    grads: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``outs[i] = grads[i] · inv_scale``; return (sum of squares, max |·|) of the outs.

    grads: tensors of any shape and strides (fp32 / bf16 / fp16); outs: same shapes, any float
    dtype (an out may be its grad: in place). inv_scale: 0-dim fp32 on the grads' device.
    Returns two 0-dim fp32 tensors on that device; the sum is 0 when ``norm`` is False.
    One tensor at a time: a multiply, a dot product and a min/max per tensor.
    """
    squares: list[torch.Tensor] = []
    maxima: list[torch.Tensor] = []
    for g, out in zip(grads, outs, strict=True):
        if g.numel() == 0:
            continue
        if g.dtype == torch.float32 and out.dtype == torch.float32:
            stored = torch.mul(g, inv_scale, out=out)  # fp32 in, fp32 out: one rounding
        else:
            y = g.float() * inv_scale  # the product in fp32
            out.copy_(y)  # one rounding into out's dtype
            stored = out if out.dtype == torch.float32 else y.copy_(out)  # stored, in fp32
        flat = stored.reshape(-1)
        if norm:
            squares.append(torch.dot(flat, flat))
        lo, hi = torch.aminmax(flat)  # both NaN when flat holds a NaN
        maxima.append(torch.maximum(-lo, hi))
    zero = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    sumsq = torch.stack(squares).sum() if squares else zero
    amax = torch.stack(maxima).amax() if maxima else zero.clone()
    return sumsq, amax


def unscaled_stats(
    grads: Sequence[torch.Tensor], inv_scale: torch.Tensor, norm: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squares, max |·|) of ``fp32(grads[i]) · inv_scale``, read-only.

    Bit for bit what ``unscale_stats`` returns with fp32 outs (same products, same per-tensor
    dot products and reductions); the grads are not written. One temporary per tensor.
    """
    squares: list[torch.Tensor] = []
    maxima: list[torch.Tensor] = []
    for g in grads:
        if g.numel() == 0:
            continue
        flat = torch.mul(g, inv_scale) if g.dtype == torch.float32 else g.float() * inv_scale
        flat = flat.reshape(-1)
        if norm:
            squares.append(torch.dot(flat, flat))
        lo, hi = torch.aminmax(flat)
        maxima.append(torch.maximum(-lo, hi))
    zero = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    sumsq = torch.stack(squares).sum() if squares else zero
    amax = torch.stack(maxima).amax() if maxima else zero.clone()
    return sumsq, amax


def found_inf_from_max(amax: torch.Tensor) -> torch.Tensor:
    """0-dim fp32: 1.0 when the max |value| is inf or NaN (some value was), else 0.0."""
    return (~torch.isfinite(amax)).to(torch.float32)


def clip_coefficient(
    total_norm: torch.Tensor, max_norm: float | torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """0-dim fp32 ``min(1, max_norm / (total_norm + eps))`` on total_norm's device (NaN stays NaN)."""
    coef = max_norm / (total_norm.to(torch.float32) + eps)
    return torch.clamp(coef, max=1.0)


def scale_(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-dim tensor ``coef`` (computed in fp32)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, coef.to(device=device, dtype=torch.float32))
