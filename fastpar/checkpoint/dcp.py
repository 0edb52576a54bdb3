"""``torch.distributed.checkpoint`` (DCP) over fastpar's shards: DTensors of the global tensors
built from the marks (``to_dtensor_state_dict`` / ``from_dtensor_state_dict``, ``save`` /
``load``), loadable under another layout.

WARNING: raw DCP on fastpar's plain shards (``dcp.save(model.state_dict())`` of a TP model)
saves without error and reloads ONE rank's shard on every rank; ``check_state_dict`` refuses
such a state dict. The placements: docs/interop.md ("torch.distributed.checkpoint")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar.checkpoint.state import checkpoint_name, global_shape
from fastpar.comm import plain
from fastpar.mesh.bridge import is_dtensor
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import expert_layout, marked_shard_index, marked_shard_of, param_layout
from fastpar.mesh.ranks import group_rank, group_size


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


@dataclass(frozen=True)
class _Plan:
    """How one local tensor maps to its DTensor: placements per sub-mesh dim, global shape,
    and for a TP-sharded tensor its dim, its rows kept (``valid``) and fused block count."""

    placements: tuple
    shape: tuple[int, ...]
    dim: int | None = None
    valid: int = 0
    fused: int = 1


def _plan(name: str, p: torch.Tensor, sub, mesh: ParallelMesh) -> _Plan:
    from torch.distributed.tensor import Replicate, Shard

    if is_dtensor(p):
        raise TypeError(
            f"{name!r} is already a DTensor (FSDP2 / torch tensor parallelism): this bridge "
            f"takes fastpar's plain local tensors; save torch's DTensors with DCP directly"
        )
    names = sub.mesh_dim_names
    placements = [Replicate() for _ in names]
    shape = tuple(global_shape(p))
    layout, ex = param_layout(p), expert_layout(p)
    if ex is not None and ex.group is not None and group_size(ex.group) > 1:
        if "ep" not in names or _ranks(ex.group) != _ranks(sub.get_group("ep")):
            raise ValueError(
                f"{name!r} holds experts split over ranks {_ranks(ex.group)}, not the "
                f"DeviceMesh's 'ep' dim; take the expert grid: mesh.to_device_mesh()"
            )
        placements[names.index("ep")] = Shard(0)
    if layout is None or layout.kind != "sharded" or group_size(layout.group) == 1:
        return _Plan(tuple(placements), shape)
    if _ranks(layout.group) != _ranks(mesh.tp_group):
        raise ValueError(
            f"{name!r} is sharded over ranks {_ranks(layout.group)}, not the mesh's "
            f"tensor-parallel group {_ranks(mesh.tp_group)}; build its layer with mesh=mesh"
        )
    d, n = layout.dim, p.shape[layout.dim]
    placements[names.index("tp")] = Shard(d)
    if layout.fused > 1 and n * group_size(layout.group) != layout.full_size:
        raise ValueError(f"{name!r}: fused blocks with padding cannot be converted")
    valid = max(0, min(n, layout.full_size - group_rank(layout.group) * n))
    return _Plan(tuple(placements), shape, d, valid, layout.fused)


def _fused_to_global_chunk(p: torch.Tensor, plan: _Plan, group) -> torch.Tensor:
    """This rank's ``Shard(dim)`` chunk of the true global tensor, from fastpar's fused layout
    (1/tp of each of the ``fused`` blocks): one all-gather over ``group``."""
    world, k = group_size(group), plan.fused
    local = p.detach().movedim(plan.dim, 0).contiguous()
    gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))
    plain.all_gather_into_tensor(gathered, local, group=group)
    per = local.shape[0] // k
    full = gathered.view(world, k, per, *local.shape[1:]).transpose(0, 1).reshape(gathered.shape)
    return full.chunk(world, 0)[group_rank(group)].movedim(0, plan.dim).contiguous()


def _global_chunk_to_fused(local: torch.Tensor, plan: _Plan, group) -> torch.Tensor:
    """Inverse of ``_fused_to_global_chunk``: fastpar's fused local tensor from this rank's
    chunk of the global tensor."""
    world, k = group_size(group), plan.fused
    chunk = local.movedim(plan.dim, 0).contiguous()
    full = chunk.new_empty((world * chunk.shape[0], *chunk.shape[1:]))
    plain.all_gather_into_tensor(full, chunk, group=group)
    per = chunk.shape[0] // k
    mine = full.view(k, world, per, *chunk.shape[1:])[:, group_rank(group)]
    return mine.reshape(chunk.shape).movedim(0, plan.dim)


def _local_of(p: torch.Tensor, plan: _Plan, mesh: ParallelMesh) -> torch.Tensor:
    if plan.dim is None:
        return p.detach()
    if plan.fused > 1:
        return _fused_to_global_chunk(p, plan, mesh.tp_group)
    local = p.detach().narrow(plan.dim, 0, plan.valid)
    return local if local.is_contiguous() else local.contiguous()


def _plans(
    model_params: Mapping[str, torch.Tensor], mesh: ParallelMesh, device_mesh: DeviceMesh | None
):
    """(checkpoint name, parameter, plan) of every entry; one entry per checkpoint name."""
    device_mesh = mesh.to_device_mesh() if device_mesh is None else device_mesh
    sub = device_mesh[tuple(n for n in device_mesh.mesh_dim_names if n != "pp")]
    seen: dict[str, torch.Tensor] = {}
    out = []
    for name, p in model_params.items():
        key = checkpoint_name(name, p)
        if key in seen:
            if seen[key] is not p:
                raise ValueError(f"two tensors are saved as {key!r}; give them distinct names")
            continue
        seen[key] = p
        out.append((key, p, _plan(key, p, sub, mesh)))
    return sub, out


def to_dtensor_state_dict(
    model_params: Mapping[str, torch.Tensor],
    mesh: ParallelMesh,
    *,
    device_mesh: DeviceMesh | None = None,
) -> dict:
    """{checkpoint name: DTensor of the global tensor} for ``model_params`` ({name: local
    tensor}, e.g. ``dict(model.named_parameters())``), for ``torch.distributed.checkpoint``'s
    save and load (see docs/interop.md). Local tensors are shared (views) where the
    layout allows; fused q|k|v tensors are converted with one all-gather over TP.
    ``device_mesh``: a DeviceMesh with the mesh's groups (default ``mesh.to_device_mesh()``).
    Collective over TP when a fused tensor is present."""
    from torch.distributed.tensor import DTensor

    sub, plans = _plans(model_params, mesh, device_mesh)
    out = {}
    for key, p, plan in plans:
        stride = tuple(math.prod(plan.shape[i + 1 :]) for i in range(len(plan.shape)))
        out[key] = DTensor.from_local(
            _local_of(p, plan, mesh),
            sub,
            list(plan.placements),
            run_check=False,
            shape=torch.Size(plan.shape),
            stride=stride,
        )
    return out


@torch.no_grad()
def from_dtensor_state_dict(
    state_dict: Mapping, model_params: Mapping[str, torch.Tensor], mesh: ParallelMesh
):
    """Write the DTensors of ``state_dict`` (``to_dtensor_state_dict`` of these parameters,
    after ``dcp.load``) into fastpar's local tensors ``model_params``; padding rows stay zero.
    Collective over TP when a fused tensor is present."""
    _, plans = _plans(model_params, mesh, None)
    for key, p, plan in plans:
        if key not in state_dict:
            raise KeyError(f"{key!r} is not in the state dict; build it with to_dtensor_state_dict")
        dt = state_dict[key]
        if not is_dtensor(dt) or tuple(dt.placements) != plan.placements:
            got = tuple(dt.placements) if is_dtensor(dt) else type(dt).__name__
            raise ValueError(
                f"{key!r} is {got}, not a DTensor placed {plan.placements} as this layout "
                f"needs; build the state dict with to_dtensor_state_dict(params, mesh)"
            )
        local = dt.to_local()
        if plan.fused > 1:
            p.copy_(_global_chunk_to_fused(local, plan, mesh.tp_group))
        elif plan.dim is not None:
            target = p.narrow(plan.dim, 0, plan.valid)
            if target.data_ptr() != local.data_ptr() or target.stride() != local.stride():
                target.copy_(local)
        elif p.data_ptr() != local.data_ptr():
            p.copy_(local)


def save(
    model_params: Mapping[str, torch.Tensor], checkpoint_id, mesh: ParallelMesh, **kwargs
) -> None:
    """``torch.distributed.checkpoint.save`` of ``to_dtensor_state_dict(model_params, mesh)``;
    ``kwargs`` go to DCP (storage_writer, planner, ...)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(to_dtensor_state_dict(model_params, mesh), checkpoint_id=checkpoint_id, **kwargs)


def load(
    model_params: Mapping[str, torch.Tensor], checkpoint_id, mesh: ParallelMesh, **kwargs
) -> None:
    """``torch.distributed.checkpoint.load`` into ``model_params`` under this (any) layout:
    DTensors from the marks, DCP's resharding read, then the write-back into the locals."""
    import torch.distributed.checkpoint as dcp

    state_dict = to_dtensor_state_dict(model_params, mesh)
    dcp.load(state_dict, checkpoint_id=checkpoint_id, **kwargs)
    from_dtensor_state_dict(state_dict, model_params, mesh)


def check_state_dict(
    state_dict: Mapping,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Raise if ``state_dict`` (for DCP) holds, at any depth, a plain tensor that is this rank's
    shard of a tensor split over several ranks (a fastpar TP or EP mark): DCP would save one
    rank's shard and reload it everywhere. A value is traced by its own marks, by its memory
    (``fastpar.mesh.placement.marked_shard_of``) and by the parameter whose name (``model``) or
    number (``optimizer``) it is under: docs/interop.md."""
    marked = dict(model.named_parameters(remove_duplicate=False)) if model is not None else {}
    numbered: dict[int, torch.Tensor] = {}
    if optimizer is not None:  # optimizer.state_dict() numbers its parameters group by group
        params = [p for group in optimizer.param_groups for p in group["params"]]
        numbered = dict(enumerate(params))
    index: dict | None = None

    def walk(value, where: str, owner: torch.Tensor | None, key) -> None:
        nonlocal index
        if isinstance(value, Mapping):
            for k, v in value.items():
                here = owner
                if isinstance(k, str) and k in marked:
                    here = marked[k]
                elif isinstance(k, int) and key == "state" and k in numbered:
                    here = numbered[k]
                walk(v, f"{where}[{k!r}]", here, k)
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]", owner, key)
            return
        if not isinstance(value, torch.Tensor) or is_dtensor(value):
            return
        ranks = _split_over(value)
        if owner is not None and value.dim() > 0:  # a scalar (a step count) is no shard
            ranks = max(ranks, _split_over(owner))
        if ranks == 1:
            index = marked_shard_index() if index is None else index
            ranks = _split_over(marked_shard_of(value, index))
        if ranks > 1:
            raise ValueError(
                f"{where} is this rank's shard of a tensor split over {ranks} ranks: "
                f"torch.distributed.checkpoint would keep one rank's shard and reload it on "
                f"every rank; convert with fastpar.checkpoint.dcp.to_dtensor_state_dict("
                f"params, mesh), or use fastpar.checkpoint.save"
            )

    walk(state_dict, "state_dict", None, None)


def _split_over(t: torch.Tensor | None) -> int:
    """Over how many ranks the tensor ``t`` is a part of is split (its TP / EP marks)."""
    layout, ex = (None, None) if t is None else (param_layout(t), expert_layout(t))
    n = 1
    if layout is not None and layout.kind == "sharded":
        n = max(n, group_size(layout.group))
    if ex is not None and ex.group is not None:
        n = max(n, group_size(ex.group))
    return n
