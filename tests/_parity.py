"""Helpers for parity tests: slice a full (single-process) tensor the way a parameter is sharded."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastpar.moe.layer import aux_loss_scale
from fastpar.nn.marks import param_layout

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def local_slice(full: torch.Tensor, param: torch.Tensor, fused: int = 1) -> torch.Tensor:
    """This rank's part of ``full``, per ``param``'s mark (padded with zeros like the layer)."""
    layout = param_layout(param)
    assert layout is not None, "parameter carries no fastpar layout mark"
    if layout.kind == "replicated":
        return full
    world, rank = dist.get_world_size(layout.group), dist.get_rank(layout.group)
    dim = layout.dim
    if fused > 1:
        return torch.cat([b.chunk(world, dim)[rank] for b in full.chunk(fused, dim)], dim)
    per = math.ceil(full.shape[dim] / world)
    pad = per * world - full.shape[dim]
    if pad:
        shape = list(full.shape)
        shape[dim] = pad
        full = torch.cat([full, full.new_zeros(shape)], dim)
    return full.narrow(dim, rank * per, per)


def assert_close(actual, expected, what: str, dtype=torch.float32) -> None:
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **TOL[dtype])


def moe_rank_references(ref, xs, gs) -> tuple[list, list, list]:
    """The single-process MoE ``ref`` on each EP rank's tokens ``xs[r]`` with output gradient
    ``gs[r]`` (its aux loss added): per rank (outputs, input grads, router grads). ``ref``'s
    gradients are then left holding the sum over every rank's tokens without the aux loss —
    what each expert's gradient is under EP (every rank's tokens reach every expert)."""
    outs, x_grads, router_grads = [], [], []
    for x, g in zip(xs, gs, strict=True):
        ref.zero_grad()
        xr = x.clone().requires_grad_()
        y = ref(xr)
        (y * g).sum().add(ref.aux_loss).backward()
        outs.append(y.detach())
        x_grads.append(xr.grad)
        router_grads.append(ref.router.weight.grad.clone())
    ref.zero_grad()
    with aux_loss_scale(None):  # the aux loss stays out of backward
        for x, g in zip(xs, gs, strict=True):
            (ref(x) * g).sum().backward()
    return outs, x_grads, router_grads
