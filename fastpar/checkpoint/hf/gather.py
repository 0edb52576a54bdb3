"""``gather_state`` and ``save_hf``: a (TP / EP) sharded model gathered onto one rank and
written as a Hugging Face directory."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fastpar.checkpoint.core import _agree
from fastpar.checkpoint.format import CheckpointError
from fastpar.checkpoint.hf._common import DEFAULT_SHARD_SIZE, Rename, _targets
from fastpar.checkpoint.hf.export import export_hf
from fastpar.checkpoint.state import (
    PieceMapper,
    decode_runs,
    global_shape,
    writes_on_this_rank,
)
from fastpar.mesh.placement import param_layout
from fastpar.mesh.ranks import group_rank, group_size


# -- gathering a sharded model ----------------------------------------------------------
def _named_tensors(model_or_named_params) -> dict[str, torch.Tensor]:
    """{first name: tensor} of each distinct tensor (a module: parameters and persistent
    buffers)."""
    return {names[0]: t for names, t in _targets(model_or_named_params)}


def _union(named: dict[str, torch.Tensor], world: int) -> list[str]:
    """Every rank's names, in rank order; a name some rank lacks must be ``mark_owned`` (a
    per-head module's parameter, held by the rank holding its head) wherever it is held."""
    if world == 1:
        return list(named)
    everyone: list = [None] * world
    mine = [(n, getattr(param_layout(t), "kind", None) == "owned") for n, t in named.items()]
    dist.all_gather_object(everyone, mine)
    held = [dict(names) for names in everyone]
    union = list(dict.fromkeys(n for names in everyone for n, _ in names))
    for name in union:
        if any(name not in h for h in held) and not all(h.get(name, True) for h in held):
            raise CheckpointError(
                f"gather_state / save_hf need every rank to hold {name!r} (or it to be one "
                f"rank's own per-head entry, fastpar.mesh.placement.mark_owned); under "
                f"pipeline parallelism use fastpar.checkpoint.save, then export_hf"
            )
    return union


def gather_state(model_or_named_params, *, mesh=None, dst: int = 0) -> dict | None:
    """{name: full global tensor} of a (TP / EP) sharded model on global rank ``dst``, None on
    the other ranks (collective over the default group: every rank calls it; every rank holds
    the same names but for per-head entries ``mark_owned`` by the rank holding their head; no
    pipeline parallelism). Pieces come from the marks; with ``mesh`` only the first holder of
    duplicated data sends it. Without a process group: the model's own tensors (sharded ones
    still reassembled from their marks)."""
    named = _named_tensors(model_or_named_params)
    rank, world = group_rank(None), group_size(None)
    mapper = PieceMapper()
    out: dict[str, torch.Tensor] | None = {} if rank == dst else None
    for name in _union(named, world):
        t = named.get(name)
        sends = t is not None and (mesh is None or writes_on_this_rank(t, mesh, dp_sharded=False))
        piece = None
        if sends:
            piece = (*mapper(t, "model", t.detach(), 0, t.numel()), global_shape(t), t.dtype)
        pieces = [piece]
        if world > 1:
            pieces = [None] * world if rank == dst else None
            dist.gather_object(piece, pieces, dst=dst)
        if out is not None:
            first = next((p for p in pieces if p is not None), None)
            if first is None and t is None:
                raise CheckpointError(
                    f"no rank sent {name!r}: is the mesh the one the model was sharded with?"
                )
            shape, dtype = (first[2], first[3]) if first is not None else (global_shape(t), t.dtype)
            out[name] = _assemble(name, shape, dtype, pieces)
    return out


def _assemble(name: str, shape: list[int], dtype: torch.dtype, pieces: list) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    full = torch.zeros(numel, dtype=dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for piece in pieces:
        if piece is not None:
            idx = decode_runs(piece[0])
            full[idx] = piece[1].to(dtype)
            covered[idx] = True
    if not bool(covered.all()):
        raise CheckpointError(
            f"the ranks' pieces of {name!r} cover {int(covered.sum())} of its {numel} elements: "
            f"is the mesh the one the model was sharded with?"
        )
    return full.view(shape)


def save_hf(
    model,
    out_dir: str | os.PathLike,
    *,
    mesh=None,
    config=None,
    dtype: torch.dtype | None = None,
    rename: Rename = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    model_class: type | None = None,
) -> str:
    """Write a (TP / EP) sharded model as one Hugging Face directory: every parameter's full
    tensor is gathered onto rank 0 (``gather_state``), which writes it with ``export_hf``
    (``config`` defaults to ``model.config``). Collective over the default group: every rank
    calls it; all raise if rank 0 fails. Returns the absolute path of ``out_dir``."""
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass config=")
    state = gather_state(model, mesh=mesh)
    error: BaseException | None = None
    out = os.path.abspath(os.fspath(out_dir))
    if state is not None:
        try:
            export_hf(
                state,
                out,
                config,
                dtype=dtype,
                rename=rename,
                max_shard_size=max_shard_size,
                model_class=model_class,
            )
        except BaseException as e:
            error = e
    if not _agree(error is None):
        raise error or CheckpointError(f"rank 0 failed to write {out}")
    return out
