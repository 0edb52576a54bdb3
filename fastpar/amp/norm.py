"""The global gradient norm and inf agreement, counting every parameter exactly once.

A parameter's local gradient enters the norm on this rank only if this rank holds the
reference copy of that very tensor (``fastpar.mesh.placement.holds_reference_copy``): it is the
first (group rank 0) of every group over which the tensor is duplicated:

  * plain torch parameters (LayerNorm weights, ...) and fastpar parameters marked replicated
    (row-parallel biases) are duplicated over the tensor-parallel group;
  * parameters marked with ``mark_duplicated`` (a word embedding tied between the first and last
    pipeline stage) over that group;
  * with a mesh, data-parallel replicas over the dp group — the expert-dp group for parameters
    marked ``mark_expert`` — unless the gradients are sharded over DP (ZeRO: ``dp_replicated=False``).

Sharded parameters (column/row weights, vocab shards, distinct experts, distinct pipeline stages)
count on every rank. The local sums of squares are then summed over every rank taking part (the
world, or ``group``), so every rank gets the same total and the same clipping coefficient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from fastpar.mesh.placement import holds_reference_copy


def counts_on_this_rank(
    p: torch.Tensor, *, mesh=None, group=None, dp_replicated: bool = True
) -> bool:
    """Whether ``p``'s gradient enters the global norm on this rank (see the module docstring).

    Without a mesh, ``group`` (None = the default group) is the group over which every
    parameter is either sharded (marked) or replicated (unmarked or marked replicated).
    """
    return holds_reference_copy(p, mesh, group=group, data_parallel=dp_replicated)


def reduction_group(mesh=None, group=None):
    """Every rank that takes part in the step: the world with a mesh, else ``group``."""
    return None if mesh is not None else group


def all_reduce_norm_and_inf(
    sumsq: torch.Tensor, found_inf: torch.Tensor, *, mesh=None, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-reduce (SUM) of [found_inf, sum of squares] over every rank taking part: any
    rank's inf makes every rank's flag 1. Returns (found_inf in {0., 1.}, global L2 norm)."""
    both = torch.stack([found_inf.float().reshape(()), sumsq.float().reshape(())])
    if dist.is_initialized():
        dist.all_reduce(both, group=reduction_group(mesh, group))
    return (both[0] > 0).float(), both[1].sqrt()


def all_reduce_max(value: torch.Tensor, *, mesh=None, group=None) -> torch.Tensor:
    value = value.float().reshape(()).clone()
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=reduction_group(mesh, group))
    return value


def global_grad_norm(
    params: Iterable[torch.Tensor],
    *,
    norm_type: float = 2.0,
    mesh=None,
    group=None,
    dp_replicated: bool = True,
) -> torch.Tensor:
    """The norm of all gradients of the logical (unsharded, undeduplicated) model: a 0-dim
    fp32 tensor, identical on every rank. ``norm_type`` 2 or inf. Communicates over the world
    (with a mesh) or ``group``; no host sync."""
    grads_counted, grads = [], []
    for p in params:
        if p.grad is None:
            continue
        grads.append(p.grad)
        if counts_on_this_rank(p, mesh=mesh, group=group, dp_replicated=dp_replicated):
            grads_counted.append(p.grad)
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == float("inf"):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float())
        return all_reduce_max(local, mesh=mesh, group=group)
    if norm_type != 2.0:
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    sumsq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads_counted:
        sumsq = sumsq + g.detach().float().pow(2).sum()
    _, norm = all_reduce_norm_and_inf(sumsq, torch.zeros((), device=device), mesh=mesh, group=group)
    return norm


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    mesh=None,
    group=None,
    dp_replicated: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Like torch.nn.utils.clip_grad_norm_, for a sharded model: every rank computes the same
    global norm and scales its local gradients by min(1, max_norm / (norm + eps)). Returns the
    norm (before clipping)."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(
        params, norm_type=norm_type, mesh=mesh, group=group, dp_replicated=dp_replicated
    )
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    if params:
        torch._foreach_mul_([p.grad for p in params], coef.to(params[0].grad.device))
    return norm
