"""Whole tensors on one rank from any layout: ``gather_state`` (the parameters and buffers),
``gather_grads`` (each parameter's gradient) and ``gather_like`` (any tensor held like a
parameter), each in the single-process model's shape, placed by the parameter marks
(``fastpar.checkpoint.state.global_index``). Collective over the default group; errors are
raised on every rank (docs/checkpoints.md, "Whole tensors on one rank")."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from fastpar.checkpoint.format import CheckpointError
from fastpar.checkpoint.state import (
    PieceMapper,
    _targets,
    checkpoint_name,
    decode_runs,
    global_shape,
    writes_on_this_rank,
)
from fastpar.comm import plain
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import param_layout
from fastpar.mesh.ranks import group_rank, group_size

Piece = tuple  # (runs [n, 2], values, global shape, dtype)


def _named_tensors(model_or_named_params) -> dict[str, torch.Tensor]:
    """{first name: tensor} of each distinct tensor (a module: parameters and persistent
    buffers), a tied copy under the name of the tensor it copies (``mark_tied_copy``: the last
    pipeline stage's copy of a tied word embedding)."""
    return {checkpoint_name(names[0], t): t for names, t in _targets(model_or_named_params)}


def _union(named: Mapping[str, torch.Tensor], world: int, staged: bool) -> list[str]:
    """Every rank's names, in rank order. A name some rank lacks must be ``mark_owned`` (a
    per-head module's parameter, held by the rank holding its head) wherever it is held, or
    ``staged`` (a mesh with pipeline stages: each stage holds its own layers' names)."""
    if world == 1:
        return list(named)
    everyone: list = [None] * world
    mine = [(n, getattr(param_layout(t), "kind", None) == "owned") for n, t in named.items()]
    plain.all_gather_object(everyone, mine)
    held = [dict(names) for names in everyone]
    union = list(dict.fromkeys(n for names in everyone for n, _ in names))
    if staged:
        return union
    for name in union:
        if any(name not in h for h in held) and not all(h.get(name, True) for h in held):
            raise CheckpointError(
                f"gather_state / save_hf need every rank to hold {name!r} (or it to be one "
                f"rank's own per-head entry, fastpar.mesh.placement.mark_owned); under "
                f"pipeline parallelism pass mesh= (stages hold their own names), or use "
                f"fastpar.checkpoint.save, then export_hf"
            )
    return union


def _gather(
    names: list[str], pieces_of: Callable[[str], list[Piece]], *, dst: int, what: str
) -> dict | None:
    """{name: whole tensor} on ``dst`` from each rank's ``pieces_of(name)`` (None elsewhere).
    Elements sent by several ranks (copies) must agree. Errors are agreed: every rank raises."""
    rank, world = group_rank(None), group_size(None)
    out: dict[str, torch.Tensor] | None = {} if rank == dst else None
    error: str | None = None
    source = False  # whether ``error`` is this rank's own (not a gap left by another's)
    for name in names:
        mine: list[Piece] = []
        if error is None:
            try:
                mine = pieces_of(name)
            except (ValueError, RuntimeError, CheckpointError) as exc:
                error, source = f"rank {rank}: {name!r}: {exc}", True
        gathered = [mine]
        if world > 1:
            gathered = [None] * world if rank == dst else None
            plain.gather_object(mine, gathered, dst=dst)
        if out is not None and error is None:
            try:
                out[name] = _assemble(name, [p for ps in gathered for p in ps], what)
            except CheckpointError as exc:
                error = str(exc)
    errors = [(error, source)]
    if world > 1:
        errors = [None] * world
        plain.all_gather_object(errors, (error, source))
    # a rank's own failure first: the destination's gaps may only follow from it
    failed = sorted((not src, i, e) for i, (e, src) in enumerate(errors) if e is not None)
    if failed:
        raise CheckpointError(failed[0][2])
    return out


def _assemble(name: str, pieces: list[Piece], what: str) -> torch.Tensor:
    if not pieces:
        raise CheckpointError(
            f"no rank sent {what} of {name!r}: is the mesh the one the model was sharded with?"
        )
    shape, dtype = pieces[0][2], pieces[0][3]
    for p in pieces[1:]:
        if list(p[2]) != list(shape):
            raise CheckpointError(
                f"ranks disagree on the global shape of {name!r}: {list(shape)} and {list(p[2])}"
            )
    numel = 1
    for s in shape:
        numel *= s
    full = torch.zeros(numel, dtype=dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for piece in pieces:
        idx, values = decode_runs(piece[0]), piece[1].to(dtype)
        seen = covered[idx]
        if bool(seen.any()):  # copies: the same values, or two tensors under one name
            old, new = full[idx][seen], values[seen]
            if not bool(((old == new) | (old.isnan() & new.isnan())).all()):
                raise CheckpointError(
                    f"two ranks sent different values for the same elements of {what} of "
                    f"{name!r}: copies that disagree, or two tensors under one name (pipeline "
                    f"stages naming their layers from 0? name each stage's parameters as the "
                    f"single-process model does: fastpar.checkpoint.stage_param_names)"
                )
        full[idx] = values
        covered[idx] = True
    if not bool(covered.all()):
        raise CheckpointError(
            f"the ranks' pieces of {what} of {name!r} cover {int(covered.sum())} of its {numel} "
            f"elements: is the mesh the one the model was sharded with?"
        )
    return full.view(shape)


def _staged(mesh: ParallelMesh | None) -> bool:
    return mesh is not None and mesh.pp_size > 1


def _whole_pieces(
    named: Mapping[str, torch.Tensor],
    value_of,
    mesh: ParallelMesh | None,
    mapper: PieceMapper,
    key: str,
) -> Callable[[str], list[Piece]]:
    """pieces_of for tensors held whole, one per parameter: ``value_of(name, t)``, in ``t``'s
    local shape; sent by the first holder of each copy (every holder without a mesh)."""

    def pieces_of(name: str) -> list[Piece]:
        t = named.get(name)
        value = None if t is None else value_of(name, t)
        if value is None:
            return []
        if tuple(value.shape) != tuple(t.shape):  # checked on every holder, sender or not
            raise CheckpointError(
                f"{key} has shape {tuple(value.shape)}, but the parameter it is laid out like "
                f"has local shape {tuple(t.shape)}"
            )
        if mesh is not None and not writes_on_this_rank(t, mesh, dp_sharded=False):
            return []
        runs, values = mapper(t, key, value.detach(), 0, t.numel())
        return [(runs, values, global_shape(t), value.dtype)]

    return pieces_of


def gather_state(
    model_or_named_params, *, mesh: ParallelMesh | None = None, dst: int = 0
) -> dict | None:
    """{name: full global tensor} of a sharded model's parameters and persistent buffers (a
    module, or a {name: tensor} dict) on global rank ``dst``, None on the other ranks
    (collective over the default group: every rank calls it). Every rank holds the same names
    but for per-head entries ``mark_owned`` by the rank holding their head and, with a
    pipeline ``mesh``, each stage's own layers (named as in the single-process model).
    Without a process group: the model's own tensors (sharded ones still reassembled)."""
    named = _named_tensors(model_or_named_params)
    names = _union(named, group_size(None), _staged(mesh))
    pieces_of = _whole_pieces(named, lambda _n, t: t, mesh, PieceMapper(), "the tensor")
    return _gather(names, pieces_of, dst=dst, what="the tensor")


def gather_like(
    values, model_or_named_params, *, mesh: ParallelMesh | None = None, dst: int = 0
) -> dict | None:
    """{name: whole tensor} on ``dst`` of ``values`` ({name: tensor}), each held on this rank
    the way the model's parameter of that name is (its local shape, its marks): an optimizer
    moment, an update, a difference of two runs. A name this rank holds but ``values`` lacks
    (or maps to None) is not sent from this rank. See ``gather_state``."""
    named = {n: t for n, t in _named_tensors(model_or_named_params).items() if n in values}
    missing = sorted(set(values) - set(_named_tensors(model_or_named_params)))
    if missing:
        raise ValueError(
            f"gather_like: {missing[:3]} are not names of the model's parameters on this rank; "
            f"pass values under the names model.named_parameters() gives"
        )
    names = _union(named, group_size(None), _staged(mesh))
    pieces_of = _whole_pieces(named, lambda n, _t: values.get(n), mesh, PieceMapper(), "a value")
    return _gather(names, pieces_of, dst=dst, what="the value")


def gather_grads(
    model_or_named_params, *, mesh: ParallelMesh | None = None, dst: int = 0, wrapper=None
) -> dict | None:
    """{name: whole gradient} on ``dst`` of every parameter that requires one, in the
    single-process model's shapes (None on the other ranks; collective over the default
    group): ``p.grad``, or with ``wrapper`` (``Shard`` / ``Replicate``) its reduced gradient
    shards (docs/checkpoints.md, "Whole tensors on one rank")."""
    named = {
        n: t
        for n, t in _named_tensors(model_or_named_params).items()
        if isinstance(t, nn.Parameter) and t.requires_grad
    }
    names = _union(named, group_size(None), _staged(mesh))
    mapper = PieceMapper()
    if wrapper is None:
        pieces_of = _whole_pieces(named, lambda _n, t: t.grad, mesh, mapper, "the gradient")
    else:
        by_id: dict[int, list[Piece]] = {}
        stands: dict[int, torch.Tensor] = {}  # kept alive: the mapper caches by id
        for p, shape, values, start, stop in wrapper.grad_pieces():
            stand = stands.get(id(p))
            if stand is None:  # an empty tensor of the local shape with p's marks (ZeRO-3)
                stand = stands[id(p)] = torch.empty(tuple(shape))
                stand.__dict__.update(p.__dict__)
            if mesh is not None and not writes_on_this_rank(stand, mesh, dp_sharded=True):
                continue  # a TP replica's copy: its first holder sends it
            runs, kept = mapper(stand, "grad", values, start, stop)
            by_id.setdefault(id(p), []).append((runs, kept, global_shape(stand), values.dtype))
        pieces_of = lambda name: by_id.get(id(named[name]), []) if name in named else []  # noqa: E731
    return _gather(names, pieces_of, dst=dst, what="the gradient")
