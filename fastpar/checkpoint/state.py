"""Global tensors from local ones: where each element of a rank's (TP / EP sharded) tensor sits in
the unsharded, unpadded global tensor (``global_index``), read from the parameter marks
(docs/checkpoints.md, "Inside fastpar.checkpoint")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import (
    expert_layout,
    holds_reference_copy,
    mark_tied_copy,
    param_layout,
    tied_name,
)
from fastpar.mesh.ranks import group_rank, group_size
from fastpar.optim.pieces import SCALAR_KEYS

__all__ = ["SCALAR_KEYS", "mark_tied_copy"]  # re-exported: they live in the layers below


def checkpoint_name(name: str, p: torch.Tensor) -> str:
    """The global name ``p`` is saved and loaded under: its ``mark_tied_copy`` name, else
    ``name``."""
    return tied_name(p) or name


def global_names(model_params) -> list[tuple[str, torch.Tensor]]:
    """``model_params`` ({name: tensor}) as (checkpoint name, tensor) pairs (tied copies under
    the name of the tensor they copy)."""
    return [(checkpoint_name(name, p), p) for name, p in model_params.items()]


def _dim_maps(p: torch.Tensor) -> tuple[list[torch.Tensor], list[int], dict]:
    """Per dim: local index -> global index (-1 = padding); the global shape; a description."""
    shape = list(p.shape)
    gshape = list(shape)
    maps = [torch.arange(n, dtype=torch.int64) for n in shape]
    desc: dict = {"kind": "replicated"}
    layout = param_layout(p)
    if layout is not None and layout.kind == "sharded":
        d, full, fused = layout.dim, layout.full_size, layout.fused
        rank, world = group_rank(layout.group), group_size(layout.group)
        n = shape[d]
        i = torch.arange(n, dtype=torch.int64)
        if fused > 1:
            if n % fused or full % fused:
                raise ValueError(f"sharded dim of size {n} does not hold {fused} fused blocks")
            per = n // fused
            g = (i // per) * (full // fused) + rank * per + i % per
        else:
            g = rank * n + i
        g[g >= full] = -1
        maps[d], gshape[d] = g, full
        desc = {"kind": "sharded", "dim": d, "full_size": full, "fused": fused, "world": world}
    elif layout is not None and layout.kind == "owned":  # whole, under its own name: one holder
        desc = {"kind": "owned", "world": group_size(layout.group)}
    ex = expert_layout(p)
    if ex is not None:
        if desc["kind"] == "sharded" and desc["dim"] == 0:
            raise ValueError("an expert parameter cannot also be sharded along dim 0")
        rank, world = (0, 1) if ex.group is None else (group_rank(ex.group), group_size(ex.group))
        n = shape[0]
        if n * world != ex.num_experts:
            raise ValueError(
                f"expert parameter holds {n} experts on each of {world} EP ranks, but is marked "
                f"with num_experts={ex.num_experts}"
            )
        maps[0], gshape[0] = rank * n + torch.arange(n, dtype=torch.int64), ex.num_experts
        desc = {**desc, "experts": ex.num_experts, "ep_world": world}
    return maps, gshape, desc


def global_shape(p: torch.Tensor) -> list[int]:
    """The shape of the whole (unsharded, unpadded) tensor ``p`` is a part of."""
    return _dim_maps(p)[1]


def sharding(p: torch.Tensor) -> dict:
    """A JSON-able description of how ``p`` is split (for the checkpoint's metadata)."""
    return _dim_maps(p)[2]


def global_index(p: torch.Tensor) -> torch.Tensor:
    """int64 tensor of ``p``'s local shape: each element's flat index in the global tensor,
    -1 for padding."""
    maps, gshape, _ = _dim_maps(p)
    idx = torch.zeros(p.shape, dtype=torch.int64)
    bad = torch.zeros(p.shape, dtype=torch.bool)
    stride = 1
    for d in range(len(gshape) - 1, -1, -1):
        view = [1] * len(gshape)
        view[d] = -1
        m = maps[d].view(view)
        idx = idx + m.clamp(min=0) * stride
        bad = bad | (m < 0)
        stride *= gshape[d]
    return idx.masked_fill(bad, -1)


def localize(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of the global tensor ``full`` (any shape, global numel) laid out like
    ``p`` (padding zero), in ``full``'s dtype."""
    gidx = global_index(p)
    flat = full.reshape(-1)
    numel = 1
    for s in global_shape(p):
        numel *= s
    if flat.numel() != numel:
        raise ValueError(f"global tensor has {flat.numel()} elements, expected {numel}")
    out = flat[gidx.clamp(min=0)]
    return out.masked_fill(gidx < 0, 0)


def encode_runs(idx: torch.Tensor) -> torch.Tensor:
    """1-D int64 indices -> [n, 2] runs (start, length) of consecutive values."""
    idx = idx.reshape(-1)
    if idx.numel() == 0:
        return torch.zeros((0, 2), dtype=torch.int64)
    breaks = torch.nonzero(idx[1:] - idx[:-1] != 1).reshape(-1) + 1
    first = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    lengths = torch.diff(first, append=torch.tensor([idx.numel()]))
    return torch.stack([idx[first], lengths], dim=1)


def decode_runs(runs: torch.Tensor) -> torch.Tensor:
    """Inverse of ``encode_runs``."""
    if runs.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    starts, lengths = runs[:, 0], runs[:, 1]
    offsets = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    pos = torch.arange(total, dtype=torch.int64) - offsets.repeat_interleave(lengths)
    return starts.repeat_interleave(lengths) + pos


class PieceMapper:
    """Maps pieces ``(param, key, values, start, stop)`` of local tensors to global runs,
    caching each parameter's index map."""

    def __init__(self) -> None:
        self._cache: dict[int, torch.Tensor] = {}

    def __call__(
        self, p: torch.Tensor, key: str, values: torch.Tensor, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(runs [n, 2], values of the kept (non-padding) elements, a compact copy)."""
        values = values.detach().reshape(-1)
        if values.numel() != stop - start:
            raise ValueError(
                f"piece {key!r} covers [{start}, {stop}) but holds {values.numel()} values"
            )
        if key in SCALAR_KEYS:
            if (start, stop) != (0, 1):
                raise ValueError(f"state {key!r} must be a one-element piece [0, 1)")
            return torch.tensor([[0, 1]], dtype=torch.int64), values.cpu().clone()
        gidx = self._cache.get(id(p))
        if gidx is None:
            gidx = self._cache[id(p)] = global_index(p).reshape(-1)
        g = gidx[start:stop]
        keep = g >= 0
        if bool(keep.all()):
            return encode_runs(g), values.cpu().clone()
        return encode_runs(g[keep]), values.cpu()[keep]


def writes_on_this_rank(p: torch.Tensor, mesh: ParallelMesh | None, *, dp_sharded: bool) -> bool:
    """Whether this rank writes its copy of ``p`` (or of its optimizer pieces): the rank that
    holds the reference copy (``fastpar.mesh.placement``) over the TP group for unmarked and
    replicated parameters and the DP (expert-DP) group unless ``dp_sharded`` (ZeRO). Without a
    mesh every rank writes (duplicates are dropped at load). Tied copies marked with
    ``mark_duplicated`` are written by each holder (they may have different global names)."""
    if mesh is None:
        return True
    return holds_reference_copy(p, mesh, data_parallel=not dp_sharded, duplicates=False)


def _groups_by_identity(tensors: Mapping[str, torch.Tensor]) -> list[tuple[list[str], Any]]:
    """[(every name of one tensor object, that tensor)] in first-seen order (ties grouped)."""
    out: dict[int, tuple[list[str], Any]] = {}
    for name, t in tensors.items():
        out.setdefault(id(t), ([], t))[0].append(name)
    return list(out.values())


def _targets(model_or_named_params) -> list[tuple[list[str], torch.Tensor]]:
    """[(names of one tensor, tensor)]: a module's parameters and persistent buffers (tied
    parameters under all their names), or a {name: tensor} dict."""
    if isinstance(model_or_named_params, nn.Module):
        tensors = model_or_named_params.state_dict(keep_vars=True)
    elif isinstance(model_or_named_params, Mapping):
        tensors = model_or_named_params
    else:
        raise TypeError(
            f"expected an nn.Module or a {{name: tensor}} dict, got "
            f"{type(model_or_named_params).__name__}"
        )
    return _groups_by_identity(tensors)
