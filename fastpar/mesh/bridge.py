"""Bridges between ``ParallelMesh`` and torch's ``DeviceMesh``, with the same process groups.

    dm = mesh.to_device_mesh()            # dims ("pp", "dp", "tp"); ("pp", "edp", "ep", "tp")
    mesh = ParallelMesh.from_device_mesh(dm)   # reuses the DeviceMesh's groups

Hybrid sharding names dp's two parts as torchtitan does, slowest first: ("pp", "dp_replicate",
"dp_shard", "cp", "tp"); the expert grid ("pp", "edp_replicate", "edp_shard", "ep", "tp").

``as_group(mesh, kind)`` reads a group from either mesh, once, where a layer is built
(``placement.restore_marks`` puts fastpar's parameter marks back after ``fully_shard``,
docs/interop.md)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fastpar.mesh.layout import MeshLayout

if TYPE_CHECKING:
    from fastpar.mesh.groups import ParallelMesh

#: DeviceMesh dim name -> the ParallelMesh group kind along it
DIM_KINDS = {
    "pp": "pp",
    "dp": "dp",
    "edp": "expert-dp",
    "ep": "ep",
    "tp": "tp",
    "cp": "cp",
    "dp_replicate": "dp-replicate",
    "dp_shard": "dp-shard",
    "edp_replicate": "expert-dp-replicate",
    "edp_shard": "expert-dp-shard",
}
_TOKEN = {"pp": "pp", "dp": "dp", "edp": "dp", "ep": "ep", "tp": "tp", "cp": "cp"}  # dim -> token
_TOKEN.update(dp_shard="dp", dp_replicate="dp")


def is_dtensor(t) -> bool:
    """Whether ``t`` is a torch DTensor, without importing ``torch.distributed.tensor`` (half a
    second): none can exist before that module is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def dims_of(layout: MeshLayout, dense: bool) -> list[tuple[str, int]]:
    """(name, size) of each DeviceMesh dim of ``layout``, slowest first: the order reversed;
    the expert grid ("edp", "ep") unless ``dense`` or ep = 1; with hybrid sharding dp (edp) as
    its two parts, "dp_replicate" then "dp_shard" ("edp_replicate", "edp_shard")."""
    expert = layout.ep > 1 and not dense
    sizes = layout.expert_sizes if expert else layout.dense_sizes
    out = []
    for token in reversed(layout.order.split("-")):
        if (token == "ep" and not expert) or (token == "cp" and sizes["cp"] == 1):
            continue
        name = "edp" if token == "dp" and expert else token
        if token == "dp" and layout.hybrid:
            r = layout.dp_replicate
            out += [(f"{name}_replicate", r), (f"{name}_shard", sizes["dp"] // r)]
            continue
        out.append((name, sizes[token]))
    return out


def groups_along(ranks: torch.Tensor, dim: int) -> list[list[int]]:
    """The rank lists along ``dim`` of a tensor of ranks (one per combination of the others)."""
    return ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()


def check_same_groups(layout: MeshLayout, ranks: torch.Tensor, names) -> None:
    """Every dim of ``ranks`` (named ``names``) must hold exactly ``layout``'s groups of its
    kind, or the DeviceMesh and the ParallelMesh would disagree on who talks to whom."""
    for dim, name in enumerate(names):
        kind = DIM_KINDS[name]
        along = sorted(groups_along(ranks, dim))
        if along != sorted(layout.groups[kind]):
            raise ValueError(
                f"the DeviceMesh dim {name!r} groups ranks as {along[:4]}, but fastpar's "
                f"{kind!r} groups for order {layout.order!r} are {layout.groups[kind][:4]}; "
                f"put 'ep' next to 'dp' in the order (e.g. 'tp-ep-dp-pp'), or use dense=True"
            )


def to_device_mesh(
    mesh: ParallelMesh, device_type: str | None = None, *, dense: bool = False
) -> DeviceMesh:
    """A DeviceMesh over ``mesh``'s ranks whose every dim's group IS ``mesh``'s group of that
    kind (``DeviceMesh.from_group``: nothing is created, nothing communicates)."""
    layout = mesh.layout
    dims = dims_of(layout, dense)
    names = tuple(n for n, _ in dims)
    ranks = torch.arange(layout.world_size).reshape([s for _, s in dims])
    check_same_groups(layout, ranks, names)
    if not device_type:  # where a DeviceMesh of this job lives: "cuda" under NCCL
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return DeviceMesh.from_group(
        [mesh.group(DIM_KINDS[n]) for n in names],
        device_type,
        mesh=ranks,
        mesh_dim_names=names,
    )


def _strides(ranks: torch.Tensor) -> list[int]:
    """The step of the rank along each dim (0 for a size-1 dim); raises unless ``ranks`` holds
    every rank of the world once, each dim a fixed step."""
    n, flat = ranks.numel(), ranks.reshape(-1)
    if n != dist.get_world_size() or sorted(flat.tolist()) != list(range(n)):
        raise ValueError(
            f"the DeviceMesh holds ranks {flat.tolist()}, not each rank of the world (size "
            f"{dist.get_world_size()}) once; build it over the whole world, e.g. "
            f"init_device_mesh(device, shape, mesh_dim_names=...)"
        )
    strides, grid = [], torch.zeros_like(ranks)
    for d, size in enumerate(ranks.shape):
        stride = int(ranks.narrow(d, 1, 1).reshape(-1)[0]) - int(flat[0]) if size > 1 else 0
        strides.append(stride)
        grid = grid + (torch.arange(size) * stride).view(
            [-1 if i == d else 1 for i in range(ranks.dim())]
        )
    if int(flat[0]) != 0 or not torch.equal(grid, ranks):
        raise ValueError(
            f"the DeviceMesh's ranks {ranks.tolist()} are not a grid fastpar can lay out (each "
            f"dim a fixed step of ranks); build it with init_device_mesh(device, shape, "
            f"mesh_dim_names=...), or take ParallelMesh.to_device_mesh()"
        )
    return strides


def _complete(tokens: list[str]) -> list[str]:
    """An order string's tokens from those of the dims larger than 1 (fastest first): the
    missing ones, of size 1, where they change nothing (tp first, pp last, ep next to dp)."""
    t = list(tokens)
    if "tp" not in t:
        t.insert(0, "tp")
    if "pp" not in t:
        t.append("pp")
    if "dp" not in t:
        t.insert(t.index("ep") + 1 if "ep" in t else t.index("pp"), "dp")
    if "ep" not in t:
        t.insert(t.index("dp"), "ep")
    return t


def layout_of_device_mesh(device_mesh: DeviceMesh) -> tuple[dict, dict[tuple[int, ...], object]]:
    """(ParallelMesh keyword arguments: tp, pp, ep, order; {rank tuple: process group}) for a
    DeviceMesh whose dims are named among "pp", "dp", "edp", "ep", "tp" (size-1 "cp" is
    ignored): the order is the dims from fastest to slowest, and every group along a dim is
    handed to the ParallelMesh instead of a new one."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"from_device_mesh needs a torch DeviceMesh, got {type(device_mesh)}")
    names = device_mesh.mesh_dim_names
    if not names:
        raise ValueError(
            "the DeviceMesh has no mesh_dim_names; name its dims among "
            f"{list(DIM_KINDS)}, e.g. init_device_mesh(device, shape, mesh_dim_names=('dp', 'tp'))"
        )
    ranks = device_mesh.mesh.to(torch.int64)
    keep = []
    for d, name in enumerate(names):
        size = ranks.shape[d]
        if name == "cp" and size == 1:
            continue
        if name not in DIM_KINDS:
            raise ValueError(
                f"the DeviceMesh dim {name!r} (size {size}) has no fastpar counterpart; "
                f"name its dims among {list(DIM_KINDS)} (dp = edp x ep with expert parallelism)"
            )
        keep.append(d)
    if "dp" in names and ("ep" in names or "edp" in names):
        raise ValueError(
            f"the DeviceMesh dims {names} name both 'dp' and an expert dim; with expert "
            f"parallelism name the data-parallel dims 'edp' and 'ep' (dp = edp x ep)"
        )
    halves = [n in names for n in ("dp_shard", "dp_replicate")]
    if any(n in names for n in ("edp_shard", "edp_replicate")) or (
        any(halves) and ("dp" in names or "ep" in names or not all(halves))
    ):
        raise ValueError(
            f"the DeviceMesh dims {names}: hybrid sharding takes both 'dp_shard' and "
            f"'dp_replicate' (torchtitan's names), without 'dp' and without expert dims; "
            f"build expert layouts with ParallelMesh(..., dp_shard=...) and to_device_mesh()"
        )
    drop = [d for d in range(ranks.dim()) if d not in keep]
    for d in sorted(drop, reverse=True):
        ranks = ranks.select(d, 0)
    names = [names[d] for d in keep]
    strides = _strides(ranks)
    by_speed = sorted((s, _TOKEN[name]) for s, name in zip(strides, names, strict=True) if s)
    tokens = _complete(list(dict.fromkeys(token for _, token in by_speed)))
    sizes = dict(zip(names, ranks.shape, strict=True))
    ep = sizes.get("ep", 1)
    kwargs = {"tp": sizes.get("tp", 1), "pp": sizes.get("pp", 1), "ep": ep}
    if sizes.get("cp", 1) > 1:
        kwargs["cp"] = sizes["cp"]
    if all(halves):
        kwargs["dp_shard"] = sizes["dp_shard"]
    layout = MeshLayout(dist.get_world_size(), **kwargs, order="-".join(tokens))
    check_same_groups(layout, ranks, names)
    provided: dict[tuple[int, ...], object] = {}
    for d, name in enumerate(names):
        group, along = device_mesh.get_group(name), groups_along(ranks, d)
        members = dist.get_process_group_ranks(group)
        if members not in along:
            raise ValueError(f"the DeviceMesh's {name!r} group holds ranks {members}")
        for g in along:
            provided.setdefault(tuple(g), group if g == members else None)
    return {**kwargs, "order": layout.order}, provided


_DIM_OF_KIND = {kind: name for name, kind in DIM_KINDS.items()}


def as_group(
    mesh: ParallelMesh | DeviceMesh | None, kind: str = "tp", group: dist.ProcessGroup | None = None
) -> dist.ProcessGroup | None:
    """The process group of ``kind`` (a ``GROUP_KINDS`` key, or "context": the cp group, None
    without context parallelism) that a layer communicates over, converted once where it is
    built: ``mesh``'s (a ParallelMesh's ``tp_group``, ``ep_group``, ...; a DeviceMesh's dim of
    that kind, "edp" for "expert-dp", a 1-D DeviceMesh without names taken whole, as torch's
    ``parallelize_module`` takes it), else ``group`` (None: the default group). Both given:
    they must be the same group."""
    if mesh is None:
        return group
    if isinstance(mesh, DeviceMesh):
        names, dim = mesh.mesh_dim_names or (), _DIM_OF_KIND.get(kind, kind)
        if dim in names:
            found = mesh.get_group(dim)
        elif mesh.ndim == 1 and not names:
            found = mesh.get_group()
        else:
            raise ValueError(
                f"mesh= is a DeviceMesh with dims {names or mesh.ndim} and no {dim!r} dim; pass a "
                f"DeviceMesh that names its {kind} dim {dim!r} (ParallelMesh.to_device_mesh() "
                f"does), or group=device_mesh.get_group(<dim>)"
            )
    else:
        attr = f"{kind.replace('-', '_')}_group"  # ParallelMesh.tp_group, .context_group, ...
        if not hasattr(mesh, attr):
            raise TypeError(
                f"mesh= takes a fastpar ParallelMesh or a torch DeviceMesh, got "
                f"{type(mesh).__name__}; pass a process group as group="
            )
        found = getattr(mesh, attr)
    if group is not None and group is not found:
        raise ValueError("pass either group= or mesh=, not both")
    return found
