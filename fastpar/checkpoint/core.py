"""``save`` and ``load``: sharded checkpoints that survive a crash and a change of layout.

    save("ckpt/step_100", model_params=names, optimizer=opt, mesh=mesh, step=100)
    info = load("ckpt/step_100", model_params=names, optimizer=opt, mesh=mesh)

Who writes which piece and how a load rebuilds this rank's part: docs/checkpoints.md ("Inside
fastpar.checkpoint")."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpar.amp.protocols import AmpOptimizer
from fastpar.checkpoint import format as fmt
from fastpar.checkpoint import spans as spans_mod
from fastpar.checkpoint.lookup import Lookup, load_wants, value_key
from fastpar.checkpoint.reader import CheckpointReader
from fastpar.checkpoint.rng import get_rng_state, set_rng_state
from fastpar.checkpoint.spans import merge as merge_spans
from fastpar.checkpoint.spans import split as split_piece
from fastpar.checkpoint.state import (
    SCALAR_KEYS,
    PieceMapper,
    global_names,
    global_shape,
    sharding,
    writes_on_this_rank,
)
from fastpar.comm import plain
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.ranks import group_rank, group_size
from fastpar.optim.pieces import (
    CheckpointPieces,
    ReplicatedPieces,
    load_torch_optimizer_pieces,
    torch_optimizer_pieces,
)


def stage_param_names(stage: nn.Module, start: int) -> dict[str, nn.Parameter]:
    """Global names of a pipeline stage's parameters: ``build_stage`` numbers its blocks from 0
    ("i.xxx"); the whole model numbers them from ``start`` (f"{start + i}.xxx"). A tied copy
    (``mark_tied_copy``: the last stage's LM head at pp > 1) keeps its stage name here; ``save``
    and ``load`` map it to the tensor it copies."""
    out = {}
    for name, p in stage.named_parameters():
        head, _, rest = name.partition(".")
        if not head.isdigit():
            raise ValueError(f"parameter {name!r} is not inside a numbered block of the stage")
        out[f"{start + int(head)}.{rest}" if rest else str(start + int(head))] = p
    return out


def layout_of(mesh: ParallelMesh | None) -> dict:
    """The layout a checkpoint is saved under (compared at load to decide on RNG restore):
    tp, pp, dp, ep, cp, the hybrid split of dp (``dp_shard`` x ``dp_replicate``; full sharding:
    dp x 1) and the rank order."""
    world = group_size(None)
    if mesh is None:
        return {"world_size": world, "mesh": None}
    sizes = {k: getattr(mesh, f"{k}_size") for k in ("tp", "pp", "dp", "ep", "cp")}
    hybrid = {k: getattr(mesh.layout, k) for k in ("dp_shard", "dp_replicate")}
    return {"world_size": world, "mesh": {**sizes, **hybrid, "order": mesh.layout.order}}


def saved_layout(layout: dict) -> dict:
    """``layout_of``'s fields of a saved layout record; one written before the hybrid fields
    existed (no ``dp_shard``) was saved at full sharding: dp_shard = dp, dp_replicate = 1; one
    without ``cp``: the world over tp x pp x dp (its ranks' product)."""
    mesh = layout.get("mesh")
    if mesh is not None and "dp_shard" not in mesh:
        mesh = {**mesh, "dp_shard": mesh["dp"], "dp_replicate": 1}
    if mesh is not None and "cp" not in mesh:
        mesh = {**mesh, "cp": layout["world_size"] // (mesh["tp"] * mesh["pp"] * mesh["dp"])}
    return {"world_size": layout["world_size"], "mesh": mesh}


def optimizer_pieces(optimizer) -> list:
    """``checkpoint_pieces`` of ``optimizer`` (a torch optimizer or anything implementing it)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, CheckpointPieces):
        return optimizer.checkpoint_pieces()
    if isinstance(optimizer, torch.optim.Optimizer):
        return torch_optimizer_pieces(optimizer)
    raise TypeError(
        f"{type(optimizer).__name__} is neither a torch optimizer nor implements "
        f"checkpoint_pieces / load_checkpoint_pieces"
    )


def _dp_sharded(optimizer) -> bool:
    """Whether the optimizer's pieces differ across DP ranks (ZeRO-like): true for anything
    implementing the protocol itself, unless it says its pieces are replicated over DP
    (``ReplicatedPieces``: a MixedPrecisionOptimizer over replicated data)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return False
    if isinstance(optimizer, ReplicatedPieces):
        return not optimizer.dp_replicated
    return True


def _amp_state(optimizer) -> tuple:
    """(scaler, skipped_steps) of an ``AmpOptimizer`` (fastpar's wrappers), else (None, None)."""
    if isinstance(optimizer, AmpOptimizer):
        return optimizer.scaler, optimizer.skipped_steps
    return None, None


def _agree(ok: bool) -> bool:
    """All ranks' ``ok``, agreed with one all-reduce (a barrier that also carries failure)."""
    return _agree_token(ok, 0)[0]


def _agree_token(ok: bool, token: int) -> tuple[bool, int]:
    """(every rank's ``ok``, the largest ``token``: rank 0's when the others pass 0), one
    all-reduce."""
    if not dist.is_initialized():
        return ok, token
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([0 if ok else 1, token], dtype=torch.int64, device=device)
    plain.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag[0].item()), int(flag[1].item())


def _collect(
    model_params: Mapping[str, torch.Tensor], optimizer, mesh: ParallelMesh | None
) -> tuple:
    """This rank's pieces: (entries for the shard file, holds {name: [keys]}, tensors)."""
    pairs = global_names(model_params)
    names: dict[int, str] = {}
    for name, p in pairs:
        names.setdefault(id(p), name)
    mapper = PieceMapper()
    entries: list[dict] = []
    holds: dict[str, list[str]] = {}
    tensors: dict[str, dict] = {}

    def add(name: str, p: torch.Tensor, key: str, values, start: int, stop: int) -> None:
        runs, vals = mapper(p, key, values, start, stop)
        shape = [1] if key in SCALAR_KEYS else tensors[name]["shape"]
        tensors[name]["keys"].setdefault(key, {"shape": shape, "dtype": str(vals.dtype)})
        if vals.numel():
            entries.append({"name": name, "key": key, "runs": runs, "values": vals})
            if key not in holds.setdefault(name, []):
                holds[name].append(key)

    for name, p in pairs:
        tensors[name] = {
            "shape": global_shape(p),
            "dtype": str(p.dtype),
            "sharding": sharding(p),
            "keys": {},
        }
        if writes_on_this_rank(p, mesh, dp_sharded=False):
            add(name, p, "model", p.detach(), 0, p.numel())
    dp_sharded = _dp_sharded(optimizer)
    for p, key, values, start, stop in optimizer_pieces(optimizer):
        name = names.get(id(p))
        if name is None:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in "
                f"model_params: pass every trained parameter under its global name"
            )
        if key == "param" and p.dtype == torch.float32:
            continue  # the fp32 master is the parameter itself: stored as "model"
        if key == "model":
            raise ValueError("'model' is a reserved checkpoint key")
        if writes_on_this_rank(p, mesh, dp_sharded=dp_sharded):
            add(name, p, key, values, start, stop)
    return entries, holds, tensors


def _merge_tensors(directory: str, world: int, ident: dict) -> tuple[dict, list[dict]]:
    """Rank 0: merge every rank's sidecar into the metadata's tensor table and file list;
    refuse a sidecar of another save (``ident``: this save's run_id and save_id)."""
    import json

    tensors: dict[str, dict] = {}
    ranks = []
    for r in range(world):
        with open(os.path.join(directory, fmt.sidecar_file(r))) as f:
            side = json.load(f)
        fmt.check_same_save(directory, f"rank {r}'s shard", side, ident)
        path = os.path.join(directory, side["file"])
        if os.path.getsize(path) != side["bytes"]:
            raise fmt.CheckpointError(f"{path} changed size while the checkpoint was saved")
        keep = ("rank", "file", "bytes", "sha256", "holds", "spans", *fmt.IDENTITY)
        ranks.append({k: side[k] for k in keep if k in side})
        for name, info in side["tensors"].items():
            mine = tensors.setdefault(name, {**info, "keys": {}})
            if mine["shape"] != info["shape"]:
                raise fmt.CheckpointError(
                    f"ranks disagree on the global shape of {name!r}: {mine['shape']} vs "
                    f"{info['shape']} (rank {r}); the same name must mean the same tensor"
                )
            for key, kinfo in info["keys"].items():
                mine["keys"].setdefault(key, kinfo)
    return tensors, ranks


def save(
    path: str | os.PathLike,
    *,
    model_params: Mapping[str, torch.Tensor],
    optimizer: Any = None,
    mesh: ParallelMesh | None = None,
    step: int,
    extra: dict | None = None,
    scaler=None,
    rng: bool = True,
    overwrite: bool = False,
    run_id: str | None = None,
) -> str:
    """Save a checkpoint to the directory ``path`` (collective: every rank calls it with its
    own parameters under their global names). ``optimizer``: a torch optimizer,
    ``MixedPrecisionOptimizer``, ``ZeroOptimizer`` or anything with ``checkpoint_pieces``;
    ``scaler`` defaults to ``optimizer.scaler``; ``extra``: anything picklable (data position,
    LR scheduler state), stored once from rank 0; ``rng``: store every rank's RNG states.
    ``path`` must not exist unless ``overwrite``. ``run_id``: the training run's identity,
    recorded with every rank's shard (docs/checkpoints.md, "Files"). Returns the absolute path.
    Needs a filesystem every rank sees."""
    rank, world = group_rank(None), group_size(None)
    final = os.path.abspath(os.fspath(path))
    partial = final + fmt.PARTIAL_SUFFIX
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"{final} exists; pass overwrite=True or save under a new name")
    if scaler is None:
        scaler = _amp_state(optimizer)[0]
    error: BaseException | None = None
    if rank == 0:
        try:
            if os.path.exists(partial):  # left by an earlier save that crashed
                shutil.rmtree(partial)
            os.makedirs(partial)
        except BaseException as e:
            error = e
    ok, save_id = _agree_token(error is None, secrets.randbits(62) + 1 if rank == 0 else 0)
    if not ok:
        raise error or fmt.CheckpointError(f"rank 0 could not create {partial}")
    ident = {"run_id": run_id, "save_id": save_id}
    layout = {
        **layout_of(mesh),
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
    }
    try:
        entries, holds, tensors = _collect(model_params, optimizer, mesh)
        entries = [
            {**e, "runs": runs, "values": values}
            for e in entries
            for runs, values in split_piece(e["runs"], e["values"], spans_mod.PIECE_BYTES)
        ]
        spans: dict[str, dict[str, list]] = {}  # what the file holds, for readers to plan by
        for e in entries:
            merge_spans(spans, e["name"], e["key"], e["runs"])
        payload = {
            "format": fmt.FORMAT,
            "version": fmt.VERSION,
            "rank": rank,
            "pieces": entries,
            "rng": get_rng_state() if rng else None,
            **ident,
        }
        size, sha = fmt.atomic_torch_save(payload, os.path.join(partial, fmt.rank_file(rank)))
        side = {
            "rank": rank,
            "file": fmt.rank_file(rank),
            "bytes": size,
            "sha256": sha,
            "holds": holds,
            "spans": spans,
            "tensors": tensors,
            **ident,
        }
        fmt.atomic_json(side, os.path.join(partial, fmt.sidecar_file(rank)))
    except BaseException as e:
        error = e
    if not _agree(error is None):
        raise error or fmt.CheckpointError(f"another rank failed to write its shard of {final}")
    if rank == 0:
        try:
            _finish(partial, final, world, step, extra, scaler, optimizer, layout, overwrite, ident)
        except BaseException as e:
            error = e
    if not _agree(error is None):
        raise error or fmt.CheckpointError(f"rank 0 failed to complete {final}")
    return final


def _finish(partial, final, world, step, extra, scaler, optimizer, layout, overwrite, ident):
    """Rank 0, once every shard is on disk: common record, metadata, marker, rename."""
    tensors, ranks = _merge_tensors(partial, world, ident)
    skipped = _amp_state(optimizer)[1]
    common = {
        "step": int(step),
        "extra": extra,
        "scaler": None if scaler is None else scaler.state_dict(),
        "skipped_steps": None if skipped is None else int(skipped),
    }
    size, sha = fmt.atomic_torch_save(common, os.path.join(partial, fmt.COMMON))
    meta = {
        "format": fmt.FORMAT,
        "version": fmt.VERSION,
        "step": int(step),
        **ident,
        "saved_at": time.time(),
        "layout": layout,
        "tensors": tensors,
        "ranks": ranks,
        "common": {"file": fmt.COMMON, "bytes": size, "sha256": sha},
    }
    _, meta_sha = fmt.atomic_json(meta, os.path.join(partial, fmt.METADATA))
    fmt.write_marker(partial, meta_sha)
    old = None
    if os.path.exists(final):
        if not overwrite:
            raise FileExistsError(f"{final} appeared while saving")
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    fmt.fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: str | os.PathLike) -> dict:
    """Check a checkpoint completely (marker, metadata, every file's size and sha256, every
    shard of one save: the same run and save id) and return its metadata; raises
    ``CheckpointError`` naming the first problem."""
    reader = CheckpointReader(os.fspath(path))
    try:
        for rank in range(len(reader.meta["ranks"])):
            reader.rank_data(rank)  # read, checksummed, its run and save id checked
            reader.release_files()
        fmt.read_verified(reader.path, reader.meta["common"])
    finally:
        reader.release()
    return reader.meta


def check_model(reader: CheckpointReader, model_params: Mapping[str, torch.Tensor]) -> None:
    """Raise unless every model tensor is in the checkpoint with the same global shape."""
    for name, p in model_params.items():
        info = reader.tensors.get(name)
        if info is None:
            some = ", ".join(list(reader.tensors)[:8])
            raise fmt.CheckpointError(
                f"model tensor {name!r} is absent from the checkpoint {reader.path} "
                f"(it holds {len(reader.tensors)} tensors: {some}, ...)"
            )
        if list(info["shape"]) != global_shape(p):
            raise fmt.CheckpointError(
                f"shape mismatch for {name!r}: the checkpoint holds {info['shape']}, the model "
                f"(global shape from its marks) {global_shape(p)}"
            )


def load_optimizer(optimizer, lookup) -> None:
    """``optimizer.load_checkpoint_pieces(lookup)``, or the torch-optimizer version."""
    if optimizer is None:
        return
    if isinstance(optimizer, CheckpointPieces):
        optimizer.load_checkpoint_pieces(lookup)
    elif isinstance(optimizer, torch.optim.Optimizer):
        load_torch_optimizer_pieces(optimizer, lookup)
    else:
        raise TypeError(f"{type(optimizer).__name__} cannot load checkpoint pieces")


def load(
    path: str | os.PathLike | CheckpointReader,
    *,
    model_params: Mapping[str, torch.Tensor],
    optimizer: Any = None,
    mesh: ParallelMesh | None = None,
    scaler=None,
    rng: bool = True,
) -> dict:
    """Load a checkpoint into this rank's ``model_params`` (global names) and ``optimizer``,
    under any layout. Restores the scaler (default ``optimizer.scaler``) and, when saved under
    the same layout and ``rng``, this rank's RNG states. No collective. Returns {"step",
    "extra", "rng_restored", "layout" (the saved one)}. Reads and checks only the records
    covering this rank's elements (``fastpar.checkpoint.reader``; docs/checkpoints.md,
    "Loading reads only what a rank needs")."""
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(os.fspath(path))
    pairs = global_names(model_params)
    check_model(reader, dict(pairs))
    names: dict[int, str] = {}
    for name, p in pairs:
        names.setdefault(id(p), name)
    rank = group_rank(None)
    lookup = Lookup(reader, names, prefer=rank)
    lookup.prepare(load_wants(reader, pairs, optimizer is not None))
    with torch.no_grad():
        for name, p in pairs:
            keys = reader.tensors[name]["keys"]
            if "model" in keys:
                value = lookup.local(name, "model", p)
            else:
                value = lookup.local(name, value_key(keys), p).float()
            p.copy_(value.to(p.dtype))
    load_optimizer(optimizer, lookup)
    common = reader.common()
    saved_scaler, skipped = _amp_state(optimizer)
    if scaler is None:
        scaler = saved_scaler
    if scaler is not None and common["scaler"] is not None:
        scaler.load_state_dict(common["scaler"])
    if torch.is_tensor(skipped) and common["skipped_steps"] is not None:
        skipped.fill_(common["skipped_steps"])
    restored = False
    if rng and layout_of(mesh) == saved_layout(reader.layout):
        state = reader.rng_state(rank)
        if state is not None:
            set_rng_state(state)
            restored = True
    reader.release()
    return {
        "step": common["step"],
        "extra": common["extra"],
        "rng_restored": restored,
        "layout": reader.layout,
    }
