"""The global gradient norm and inf agreement, counting every parameter exactly once: on the
rank holding its reference copy (``fastpar.mesh.placement``), DTensor gradients by their
placements. ``clip_grad_norm_`` with a mesh is right where torch's is not (FSDP2 + fastpar TP):
docs/layouts.md ("The global norm")."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from fastpar.comm import plain
from fastpar.mesh.bridge import is_dtensor
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import holds_reference_copy, is_expert, param_layout, replica_groups
from fastpar.mesh.ranks import group_rank, group_size


def counts_on_this_rank(
    p: torch.Tensor, *, mesh: ParallelMesh | None = None, group=None, dp_replicated: bool = True
) -> bool:
    """Whether ``p``'s gradient enters the global norm on this rank (see docs/layouts.md).

    Without a mesh, ``group`` (None = the default group) is the group over which every
    parameter is either sharded (marked) or replicated (unmarked or marked replicated).
    A DTensor gradient (or parameter) counts by its placements and by the replica groups its
    DeviceMesh does not span (``dtensor_counts_on_this_rank``).
    """
    dt = p.grad if is_dtensor(p.grad) else p
    if is_dtensor(dt):
        return dtensor_counts_on_this_rank(
            p, dt, mesh=mesh, group=group, dp_replicated=dp_replicated
        )
    return holds_reference_copy(p, mesh, group=group, data_parallel=dp_replicated)


def _members(group) -> set[int]:
    return set(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def dtensor_counts_on_this_rank(
    p: torch.Tensor, dt, *, mesh: ParallelMesh | None = None, group=None, dp_replicated: bool = True
) -> bool:
    """Whether the local tensor of the DTensor ``dt`` (``p``'s gradient) counts here: this rank
    is coordinate 0 of each Replicate dim of ``dt``'s DeviceMesh, and group rank 0 of each of
    ``p``'s replica groups (``fastpar.mesh.placement.replica_groups``) that the DeviceMesh does
    not span. A Partial placement (a gradient not yet reduced) raises."""
    device_mesh = dt.device_mesh
    for dim, placement in enumerate(dt.placements):
        if placement.is_partial():
            raise ValueError(
                f"a gradient is a DTensor with placements {tuple(dt.placements)}: a Partial "
                f"gradient is not reduced yet; reduce it (dt.redistribute(..., Replicate())) "
                f"before taking the norm"
            )
        if placement.is_replicate() and device_mesh.get_local_rank(dim) != 0:
            return False
    spanned = set(device_mesh.mesh.reshape(-1).tolist())
    me = dist.get_rank()
    for g in replica_groups(p, mesh, group=group, data_parallel=dp_replicated):
        members = _members(g)
        inside = members & spanned
        if inside == {me}:
            if group_rank(g) != 0:
                return False
        elif inside != members:
            raise ValueError(
                f"a DTensor gradient's DeviceMesh spans ranks {sorted(spanned)}, which cut its "
                f"parameter's replica group {sorted(members)}; build the DeviceMesh from the "
                f"fastpar mesh (mesh.to_device_mesh()) so each of its dims is a whole group"
            )
    return True


def _check_marks_survived(params: list[torch.Tensor], *, mesh: ParallelMesh | None, group) -> None:
    """Under FSDP2 + fastpar TP every parameter is a new DTensor without fastpar's marks: with
    none marked at all, TP-sharded weights would count as replicated (silently too small)."""
    tp = mesh.tp_size if mesh is not None else group_size(group)
    dts = [p.grad for p in params if is_dtensor(p.grad)]
    if tp == 1 or not dts or any(param_layout(p) is not None or is_expert(p) for p in params):
        return
    tp_group = mesh.tp_group if mesh is not None else group
    if all(_members(tp_group) <= set(d.device_mesh.mesh.reshape(-1).tolist()) for d in dts):
        return  # the DTensors span TP themselves (torch's own tensor parallelism)
    raise ValueError(
        f"the gradients are DTensors over a DeviceMesh that does not span the tensor-parallel "
        f"group (size {tp}) and no parameter carries a fastpar mark: fully_shard dropped them; "
        f"call fastpar.mesh.restore_marks(dict_of_params_before_fully_shard, model) after it"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a view: writing it writes the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def reduction_group(mesh: ParallelMesh | None = None, group=None):
    """Every rank that takes part in the step: the world with a mesh, else ``group``."""
    return None if mesh is not None else group


def all_reduce_norm_and_inf(
    sumsq: torch.Tensor, found_inf: torch.Tensor, *, mesh: ParallelMesh | None = None, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-reduce (SUM) of [found_inf, sum of squares] over every rank taking part: any
    rank's inf makes every rank's flag 1. Returns (found_inf in {0., 1.}, global L2 norm)."""
    both = torch.stack([found_inf.float().reshape(()), sumsq.float().reshape(())])
    if dist.is_initialized():
        plain.all_reduce(both, group=reduction_group(mesh, group))
    return (both[0] > 0).float(), both[1].sqrt()


def global_grad_norm(
    params: Iterable[torch.Tensor],
    *,
    norm_type: float = 2.0,
    mesh: ParallelMesh | None = None,
    group=None,
    dp_replicated: bool = True,
) -> torch.Tensor:
    """The norm of all gradients of the logical (unsharded, undeduplicated) model: a 0-dim
    fp32 tensor (plain, not a DTensor), identical on every rank. ``norm_type`` 2 or inf.
    Communicates over the world (with a mesh) or ``group``; no host sync. DTensor gradients
    (FSDP2) count once over the whole mesh (see docs/layouts.md)."""
    params = [p for p in params if p.grad is not None]
    _check_marks_survived(params, mesh=mesh, group=group)
    grads_counted, grads = [], []
    for p in params:
        grads.append(_local(p.grad))
        if counts_on_this_rank(p, mesh=mesh, group=group, dp_replicated=dp_replicated):
            grads_counted.append(grads[-1])
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == float("inf"):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float())
        if dist.is_initialized():
            plain.all_reduce(local, op=dist.ReduceOp.MAX, group=reduction_group(mesh, group))
        return local
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
    mesh: ParallelMesh | None = None,
    group=None,
    dp_replicated: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Like torch.nn.utils.clip_grad_norm_, for a sharded model: every rank computes the same
    global norm and scales its local gradients by min(1, max_norm / (norm + eps)). Returns the
    norm (before clipping). Also for FSDP2 over fastpar's TP layers (docs/interop.md)."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(
        params, norm_type=norm_type, mesh=mesh, group=group, dp_replicated=dp_replicated
    )
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    if params:
        grads = [_local(p.grad) for p in params]
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
