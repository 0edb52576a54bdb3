"""Checkpoints under hybrid sharding: ZeRO-3 at dp-shard 2 x dp-replicate 2 saves each piece
once (replicate rank 0 writes it), and the checkpoint loads into any R x S layout and ZeRO stage:
every parameter and every optimizer-state element this rank then holds equals, bit for bit,
the saved run's; in the saved layout the next step continues bit-identically, in every other
(another order of the gradient sums) within ``fastpar.tolerance``'s rule of the single
process's three steps in float64."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _training import check, global_batch, mse_loss, references
from torch import nn

from fastpar import ParallelMesh, checkpoint
from fastpar.checkpoint import format as fmt
from fastpar.parallel import Replicate, Shard
from fastpar.testing import run_ranks

# (ZeRO stage, dp_shard) of each layout the checkpoint is loaded into; the first is the saved one
LAYOUTS = [(3, 2), (1, None), (2, 1), (3, 4), (0, None)]  # stage 0: DDP (Replicate)
LR = 1e-2


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5))


def _wrap(stage: int, dp_shard: int | None):
    torch.manual_seed(dist.get_rank() + 7)  # any start: the load overwrites it
    model = _model()
    mesh = ParallelMesh(dp_shard=dp_shard)
    unit = {"wrap": (nn.Linear,)} if stage == 3 else {}
    if stage == 0:
        return model, mesh, Replicate(model, _adamw, mesh=mesh)
    return model, mesh, Shard(model, _adamw, stage=stage, mesh=mesh, **unit)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def _step(model, w, step: int) -> None:
    rank = dist.get_rank()
    x, y = global_batch(step, 1, dist.get_world_size(), 7, 5)
    F.mse_loss(w(x[0, rank]), y[0, rank]).backward()
    w.step()
    w.zero_grad()


def _pieces(model, w) -> dict:
    """{(name, key): (start, stop, values)} of the pieces this rank holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        (names[id(p)], key, start): (stop, values.detach().clone())
        for p, key, values, start, stop in w.checkpoint_pieces()
    }


def _params(model, w) -> dict:
    with w.summon_full_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reshard(path: str) -> dict:
    model, mesh, w = _wrap(*LAYOUTS[0])  # rank 0's start, broadcast over dp
    for step in range(2):
        _step(model, w, step)
    saved = _pieces(model, w)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, saved)
    full = {}
    for pieces in everyone:  # each piece written once: by replicate rank 0, not its replica
        for (name, key, start), (stop, values) in pieces.items():
            assert start not in full.setdefault((name, key), {}), (name, key, start)
            full[(name, key)][start] = (stop, values)
    before = _params(model, w)
    with w.summon_full_params():
        checkpoint.save(
            path, model_params=dict(model.named_parameters()), optimizer=w, mesh=mesh, step=2
        )
    _step(model, w, 2)
    after = _params(model, w)
    out = {}
    for stage, dp_shard in LAYOUTS:
        model_b, mesh_b, w_b = _wrap(stage, dp_shard)
        with w_b.summon_full_params():
            names = dict(model_b.named_parameters())
            checkpoint.load(path, model_params=names, optimizer=w_b, mesh=mesh_b)
        mismatched = []
        for (name, key, start), (stop, values) in _pieces(model_b, w_b).items():
            # the saved run's elements [start, stop) of this tensor, from its pieces
            whole = torch.cat([v for _, (_, v) in sorted(full[(name, key)].items())])
            if key != "step" and not torch.equal(values, whole[start:stop]):
                mismatched.append((name, key, start))
        same = all(torch.equal(p, before[n]) for n, p in _params(model_b, w_b).items())
        _step(model_b, w_b, 2)
        stepped = _params(model_b, w_b)
        continued = all(torch.equal(p, after[n]) for n, p in stepped.items())
        out[(stage, dp_shard)] = (mismatched, same, continued, mesh_b.layout.dp_replicate)
        out[(stage, dp_shard), "stepped"] = stepped
    return out


def test_hybrid_checkpoints_reshard_to_any_layout(tmp_path):
    path = os.fspath(tmp_path / "step_2")
    # the saved run's math on one process: rank 0's start (seed 7), the 4 ranks' rows, 3 steps
    adamw = lambda m: _adamw(m.parameters())  # noqa: E731
    refs = references(_model, mse_loss(1, 4, 7, 5), 3, adamw, length=4 * 3 * 5, lr=LR, seed=7)
    for results in run_ranks(_reshard, 4, path):
        for layout in LAYOUTS:
            stepped = results.pop((layout, "stepped"))
            check([refs.param(n, p) for n, p in stepped.items()], f"after a load at {layout}: ")
        for (stage, dp_shard), (mismatched, same, continued, replicas) in results.items():
            where = f"ZeRO-{stage}, dp_shard {dp_shard} ({replicas} replicas)"
            assert not mismatched, f"{where}: loaded pieces differ: {mismatched[:4]}"
            assert same, f"{where}: the loaded parameters differ from the saved ones"
            if (stage, dp_shard) == LAYOUTS[0]:
                assert continued, f"{where}: the saved layout does not continue bit-identically"


def _rng_restored(root: str) -> dict:
    """{(saved split, loaded split): rng_restored} for dp 2 = 1 x 2 (hybrid) and 2 x 1 (full)."""
    torch.manual_seed(0)
    names = dict(nn.Linear(3, 2).named_parameters())
    meshes = {(1, 2): ParallelMesh(dp_shard=1), (2, 1): ParallelMesh()}
    out = {}
    for saved, mesh in meshes.items():
        path = os.path.join(root, str(saved))
        checkpoint.save(path, model_params=names, mesh=mesh, step=1)
        for loaded, other in meshes.items():
            info = checkpoint.load(path, model_params=names, mesh=other)
            record = info["layout"]["mesh"]
            assert (record["dp_shard"], record["dp_replicate"]) == saved
            out[saved, loaded] = info["rng_restored"]
    old = os.path.join(root, "old")  # a record from before the hybrid fields
    checkpoint.save(old, model_params=names, mesh=meshes[2, 1], step=1)
    if dist.get_rank() == 0:
        with open(os.path.join(old, fmt.METADATA)) as f:
            meta = json.load(f)
        for key in ("dp_shard", "dp_replicate"):
            del meta["layout"]["mesh"][key]
        fmt.write_marker(old, fmt.atomic_json(meta, os.path.join(old, fmt.METADATA))[1])
    dist.barrier()
    for loaded, other in meshes.items():
        info = checkpoint.load(old, model_params=names, mesh=other)
        assert "dp_shard" not in info["layout"]["mesh"]
        out["old", loaded] = info["rng_restored"]
    return out


def test_the_layout_record_tells_hybrid_from_full_sharding(tmp_path):
    """The saved layout names dp-shard x dp-replicate, so the RNG states come back only in the
    same split (dp 2 = 1 x 2 is not dp 2 = 2 x 1); a record from before these fields (no
    ``dp_shard``) reads as full sharding."""
    for got in run_ranks(_rng_restored, 2, str(tmp_path)):
        splits = [(1, 2), (2, 1)]
        assert got == {
            **{(a, b): a == b for a in splits for b in splits},
            **{("old", b): b == (2, 1) for b in splits},  # as if saved at full sharding
        }
    old = {"world_size": 2, "mesh": {"tp": 1, "pp": 1, "dp": 2, "ep": 1, "order": "tp-ep-dp-pp"}}
    mesh = {**old["mesh"], "dp_shard": 2, "dp_replicate": 1, "cp": 1}
    assert checkpoint.core.saved_layout(old) == {"world_size": 2, "mesh": mesh}
    # a record from before ``cp``: its world is tp x pp x dp x cp (8 = 1 x 1 x 2 x 4)
    older = {"world_size": 8, "mesh": {**old["mesh"], "dp_shard": 2, "dp_replicate": 1}}
    assert checkpoint.core.saved_layout(older)["mesh"]["cp"] == 4
    assert checkpoint.core.saved_layout({"world_size": 1, "mesh": None})["mesh"] is None
