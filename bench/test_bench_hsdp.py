"""Hybrid sharding: fastpar ZeRO-3 at dp-shard 2 x dp-replicate 2 against FSDP2's HSDP
(``fully_shard(mesh=2-D DeviceMesh ("dp_replicate", "dp_shard"))``) on 4 CPU ranks (gloo),
side by side, and fastpar's bytes on each group per step against the formula (exact).

Both shard every ``nn.Linear`` as its own unit (plus the root) inside the shard group,
reshard after forward, reduce-scatter fp32 gradients and all-reduce the reduced shards over
the replicas; FSDP2 is told ``set_force_sum_reduction_for_comms(True)`` (its AVG reductions
are wrong on gloo). Both must reach the same loss after the last step. Inside the same ranks
the two alternate training steps (forward, backward, AdamW) and report the median step time;
the ratio FSDP2 / fastpar is the result, CPU absolute times are noise.
Run:  pytest bench/test_bench_hsdp.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import BATCH, HIDDEN, ITERS, mlp_model
from torch import nn

from fastpar import ParallelMesh
from fastpar.parallel import Shard
from fastpar.testing import run_ranks

SHARD, REPLICATE = 2, 2


def _setup(kind: str, hidden: int):
    """(model, step(), zero_grad(), the fastpar wrapper or None)."""
    model = mlp_model(hidden)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    if kind == "fastpar-hsdp":
        mesh = ParallelMesh(dp_shard=SHARD)
        z = Shard(model, adamw, stage=3, mesh=mesh, wrap=(nn.Linear,))
        return z, z.step, z.zero_grad, z
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (REPLICATE, SHARD), mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    opt = adamw(model.parameters())
    return model, opt.step, opt.zero_grad, None


def _side_by_side(hidden: int) -> dict:
    rank = dist.get_rank()
    setups = {k: _setup(k, hidden) for k in ("fastpar-hsdp", "torch-fsdp2-hsdp")}
    x = torch.randn(BATCH, hidden, generator=torch.Generator().manual_seed(rank))
    times = {k: [] for k in setups}
    losses, sent = {}, {}
    z = setups["fastpar-hsdp"][3]
    for it in range(ITERS + 1):
        for k, (model, step, zero_grad, _) in setups.items():
            before = dict(z.comm_bytes_by)
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x), torch.zeros_like(x))
            loss.backward()
            step()
            zero_grad()
            if it:  # the first step allocates optimizer state
                times[k].append(time.perf_counter() - t0)
            if k == "fastpar-hsdp":
                sent = {key: z.comm_bytes_by[key] - before[key] for key in before}
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses[k] = float(total) / dist.get_world_size()
    return {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "sent": sent,
        "padded": z.padded_numel(),
        "losses": losses,
    }


@pytest.mark.parametrize("hidden", [HIDDEN, 2 * HIDDEN])
def test_hsdp_against_fsdp2_hsdp(benchmark, hidden):
    ours, theirs = "fastpar-hsdp", "torch-fsdp2-hsdp"
    benchmark.group = f"hsdp-vs-fsdp2-2x2-hidden{hidden}"
    res = benchmark.pedantic(run_ranks, args=(_side_by_side, SHARD * REPLICATE, hidden), rounds=1)
    t = {k: statistics.median(r["seconds"][k] for r in res) for k in (ours, theirs)}
    padded, s, r = res[0]["padded"], SHARD, REPLICATE
    ring = (s - 1) / s * padded * 4  # over the shard group, per collective
    want = {
        "all_gather_forward": ring,
        "all_gather_backward": ring,
        "reduce_scatter": ring,
        "replicate_all_reduce": 2 * (r - 1) / r * padded / s * 4,  # over the replicas
    }
    full = 3 * (s * r - 1) / (s * r) * padded * 4  # full sharding over all 4 ranks
    benchmark.extra_info.update(
        seconds=t,
        peer_time_over_fastpar=t[theirs] / t[ours],
        bytes_per_step=res[0]["sent"],
        formula=want,
        full_shard_bytes=full,
    )
    for out in res:
        for key, value in want.items():  # exact: the ring model of the collectives issued
            assert out["sent"][key] == pytest.approx(value), key
        assert out["sent"]["all_reduce"] == out["sent"]["all_gather"] == 0.0
        assert out["losses"][ours] == pytest.approx(out["losses"][theirs], rel=1e-5)
    shard_bytes = sum(
        want[k] for k in ("all_gather_forward", "all_gather_backward", "reduce_scatter")
    )
    print(
        f"\nHSDP {s}x{r}, hidden {hidden}: {ours} vs {theirs}: step {t[ours] * 1e3:.1f} vs {t[theirs] * 1e3:.1f} ms "
        f"(peer/fastpar {t[theirs] / t[ours]:.2f}); bytes/step over dp-shard "
        f"{shard_bytes / 2**20:.2f} MiB, over dp-replicate "
        f"{want['replicate_all_reduce'] / 2**20:.2f} MiB (full sharding over 4 ranks: "
        f"{full / 2**20:.2f} MiB, every collective spanning the replicas)"
    )
