"""Hybrid sharded data parallelism (HSDP) for ZeRO 1, 2, 3 on a mesh with dp_shard 2 x
dp_replicate 2 (4 ranks): the training equals the single-process model (every loss, every
gradient norm, every parameter after 3 AdamW steps, clipped), by ``fastpar.tolerance``'s rule
(docs/tolerances.md); every collective the wrapper issues is recorded and goes to the group the
layout says — reduce-scatter and all-gathers to the shard group, one all-reduce of the reduced
shard to the replicate group, only the norm over the world — so a silent fall-back to full
sharding fails; ``comm_bytes_by`` equals the formula per group."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _training import check, check_training, global_batch, mse_loss, norm, references
from torch import nn

from fastpar import ParallelMesh, tolerance
from fastpar.amp import FusedAmpStep
from fastpar.optim import FusedAdamW
from fastpar.parallel import Shard
from fastpar.testing import run_ranks
from fastpar.zero import estimate_memory

STEPS, LR, CLIP = 3, 1e-2, 0.5
RECORDED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")


def _model() -> nn.Module:
    # odd sizes: the flats need padding to the shard size
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5))


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)


@contextlib.contextmanager
def _recording(calls: list):
    """Record (collective, ranks of its group, numel) of every torch.distributed call."""
    saved = {name: getattr(dist, name) for name in RECORDED}

    def wrap(name, fn):
        def recorded(tensor, *args, **kwargs):
            group = kwargs.get("group")
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            full = args[0] if name == "reduce_scatter_tensor" else tensor  # (out, in)
            calls.append((name, ranks, full.numel()))
            return fn(tensor, *args, **kwargs)

        return recorded

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _fused(params):
    return FusedAdamW(params, lr=LR, weight_decay=0.01)


def _train(stage: int, native: bool, fused: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ParallelMesh(dp_shard=2)
    torch.manual_seed(rank)  # another init on every rank: wrapping broadcasts rank 0's over dp
    if rank == 0:
        torch.manual_seed(0)
    model = _model()
    # ZeRO-3: the 5-element LayerNorm weight and bias and the last bias stay replicated, their
    # gradients all-reduced over the whole dp
    unit = {"wrap": (nn.Linear,), "persist_below": 8} if stage == 3 else {}
    opt = _fused if fused else _adamw  # fused: the clip folded into FusedAdamW's one pass
    w = Shard(model, opt, stage=stage, mesh=mesh, max_grad_norm=CLIP, **unit)
    assert isinstance(w.optimizer, FusedAmpStep) == fused  # guarded_step's fused path
    if native:  # the NCCL path (reduce_scatter_tensor, all_gather_into_tensor) on gloo
        for f in w.flats:
            f.gloo = False
    calls: list = []
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, 1, world, 7, 5)
        with _recording(calls):
            loss = F.mse_loss(w(x[0, rank]), y[0, rank])
            loss.backward()
            _, grad_norm = w.step()
            w.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        norms.append(float(grad_norm))
    with w.summon_full_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    flats = [(f.padded, f.shard_len, f.size, f.replicate_size, f.sharded) for f in w.flats]
    memory = (w.memory_bytes(), [f.bucket.numel for f in w.flats if f.sharded])  # between steps
    return dict(
        losses=losses,
        params=params,
        norms=norms,
        calls=calls,
        comm=dict(w.comm_bytes_by),
        flats=flats,
        memory=memory,
        groups=(mesh.ranks("dp-shard-cp"), mesh.ranks("dp-replicate")),
    )


def _check_collectives(stage: int, native: bool, rank: int, out: dict) -> None:
    shard, replicas = out["groups"]
    assert shard == [rank - rank % 2, rank - rank % 2 + 1] and replicas == [rank % 2, rank % 2 + 2]
    world = [0, 1, 2, 3]
    sharded = [f for f in out["flats"] if f[4]]
    padded = {p for p, *_ in sharded}
    shard_lens = {s for _, s, *_ in sharded}
    replicated = {p for p, *_, shards in out["flats"] if not shards}
    assert bool(replicated) == (stage == 3), out["flats"]
    kinds = {"shard": 0, "replicate": 0, "norm": 0, "replicated": 0}
    for name, ranks, numel in out["calls"]:
        where = f"stage {stage}, rank {rank}: {name} over {ranks} of {numel} elements"
        if ranks == replicas:  # the one all-reduce of each reduced shard
            assert name == "all_reduce" and numel in shard_lens, where
            kinds["replicate"] += 1
        elif ranks == shard:  # reduce-scatter, all-gathers (gloo: all-reduce, broadcasts)
            allowed = ("reduce_scatter_tensor", "all_gather_into_tensor")
            if not native:
                allowed = ("all_reduce", "broadcast")
            assert name in allowed, where
            if name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"):
                assert numel in padded, where
            kinds["shard"] += 1
        else:  # nothing else crosses the replicas: the norm and inf flag (2 numbers), and the
            assert ranks == world and name == "all_reduce", where  # replicated flats
            assert numel == 2 or numel in replicated, where
            kinds["norm" if numel == 2 else "replicated"] += 1
    for *_, size, reps, shards in out["flats"]:
        assert (size, reps) == ((2, 2) if shards else (4, 1)), out["flats"]
    assert kinds["replicate"] == STEPS * len(sharded), (stage, kinds)
    assert kinds["replicated"] == STEPS * len(replicated), (stage, kinds)
    assert kinds["norm"] == STEPS and kinds["shard"] > 0, (stage, kinds)


def _formula(stage: int, flats: list) -> dict:
    """Payload bytes per step x STEPS (ring model, fp32): over the shard group of S ranks the
    reduce-scatter and the all-gathers (S-1)/S · padded · 4, over the R replicas the all-reduce
    2 (R-1)/R · (padded / S) · 4; a replicated flat's all-reduce over all N = dp ranks
    2 (N-1)/N · padded · 4."""
    keys = ("reduce_scatter", "replicate_all_reduce", "all_gather", "all_reduce")
    want = dict.fromkeys(keys, 0.0)
    for padded, shard_len, s, r, shards in flats:
        if not shards:
            want["all_reduce"] += 2 * (s - 1) / s * padded * 4 * STEPS
            continue
        ring = (s - 1) / s * padded * 4 * STEPS
        want["reduce_scatter"] += ring
        want["replicate_all_reduce"] += 2 * (r - 1) / r * shard_len * 4 * STEPS
        if stage == 3:
            want["all_gather_forward"] = want.get("all_gather_forward", 0.0) + ring
            want["all_gather_backward"] = want.get("all_gather_backward", 0.0) + ring
        else:
            want["all_gather"] += ring
    return want


@pytest.mark.parametrize("stage, fused", [(1, False), (2, False), (3, False), (2, True)])
def test_hybrid_zero_trains_like_one_process_over_the_layout_groups(stage, fused):
    refs = references(
        _model,
        mse_loss(1, 4, 7, 5),
        STEPS,
        lambda m: _adamw(m.parameters()),
        length=4 * 3 * 5,  # the loss sums 4 ranks x 3 rows of 5 outputs
        lr=LR,
        clip=CLIP,
    )
    native = stage != 2  # stages 1 and 3 on torch's native collectives, 2 on gloo's stand-ins
    outs = run_ranks(_train, 4, stage, native, fused)
    check_training(refs, [(o["losses"], o["params"]) for o in outs], f"stage {stage}: ")
    for rank, out in enumerate(outs):
        check([norm(refs, s, v) for s, v in enumerate(out["norms"])], f"rank {rank}: ")
        _check_collectives(stage, native, rank, out)
        for key, value in _formula(stage, out["flats"]).items():
            assert out["comm"][key] == pytest.approx(value), (stage, key)
        assert out["comm"]["tied"] == 0.0
        # the planner's bytes per rank with the shard group's size: the replicas change nothing
        held, numels = out["memory"]
        psi = sum(numels)
        plan = estimate_memory(
            psi,
            2,
            stage,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=8,
            mode="fastpar",
            bucket_numels=numels,
        )
        # ZeRO-3's replicated flats: fp32 parameters, reduced gradients, AdamW's two moments
        rest = sum(p for p, *_, shards in out["flats"] if not shards)
        steps = 4 * len(out["flats"])  # AdamW's "step" of each flat
        assert (held["params"], held["grads"]) == (plan.params + 4 * rest, plan.grads + 4 * rest)
        assert held["optimizer"] == plan.optimizer + 8 * rest + steps, stage


def _reduced_grads(stage: int) -> dict:
    """Two unclipped steps; after each backward, every piece of every parameter this rank's
    reduced shard holds: (step, name, start, stop, values), and the shards themselves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ParallelMesh(dp_shard=2)
    torch.manual_seed(0)
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    unit = {"wrap": (nn.Linear,), "persist_below": 8} if stage == 3 else {}
    w = Shard(model, _adamw, stage=stage, mesh=mesh, **unit)
    pieces, shards = [], []
    for step in range(2):
        x, y = global_batch(step, 1, world, 7, 5)
        F.mse_loss(w(x[0, rank]), y[0, rank]).backward()
        w.finish_grad_sync()
        for f, reduced in zip(w.flats, w.shard_grads, strict=True):
            shards.append((f.sharded, reduced.clone()))
            for o in f.owned():
                values = reduced[o.in_shard].clone()
                pieces.append((step, names[id(f.params[o.index])], o.start, o.stop, values))
        w.step()
        w.zero_grad()
    return dict(pieces=pieces, shards=shards)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_zero_reduces_every_gradient_on_every_rank(stage):
    """Each rank's reduced gradient shard, piece by piece, against the single process's
    gradient (unclipped, 2 steps); every element of every parameter held by some rank; and the
    two replicas of a shard (ranks r and r + 2) hold it bit for bit (one all-reduce gives both
    the same sum), the replicated flats of ZeRO-3 alike on all four ranks."""
    refs = references(
        _model, mse_loss(1, 4, 7, 5), 2, lambda m: _adamw(m.parameters()), length=4 * 3 * 5, lr=LR
    )
    outs = run_ranks(_reduced_grads, 4, stage)
    covered = {
        (s, n): torch.zeros(g.numel(), dtype=torch.int)
        for s, gs in enumerate(refs.exact.grads)
        for n, g in gs.items()
    }
    bad = []
    for rank, out in enumerate(outs):
        for step, name, start, stop, values in out["pieces"]:
            runs = [r.grads[step][name].flatten()[start:stop] for r in (refs.single, refs.twin)]
            c = tolerance.compare(
                values,
                runs,
                refs.exact.grads[step][name].flatten()[start:stop],
                length=refs.length,
                dtype=torch.float32,
                what=f"rank {rank}: {name}[{start}:{stop}] (gradient of step {step + 1})",
            )
            bad += [] if c.ok else [str(c)]
            covered[step, name][start:stop] += 1
    assert not bad, "\n".join(bad[:12])
    # every element twice (its shard's two replicas); four times in ZeRO-3's replicated flats
    for (step, name), seen in covered.items():
        assert set(seen.tolist()) <= {2, 4} and seen.min() > 0, (step, name, seen)
    for rank, out in enumerate(outs):
        peers = [r for r in range(4) if r != rank]
        for i, (sharded, shard) in enumerate(out["shards"]):
            holders = [rank ^ 2] if sharded else peers  # replica: the other half's same rank
            for peer in holders:
                assert torch.equal(shard, outs[peer]["shards"][i][1]), (stage, rank, peer, i)
