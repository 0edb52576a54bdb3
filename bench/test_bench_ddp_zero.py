"""fastpar DDP / ZeRO-1 / ZeRO-2 against their PyTorch peers on CPU ranks (gloo), side by side.

  DDP     vs torch.nn.parallel.DistributedDataParallel (gradient_as_bucket_view=True)
  ZeRO-1  vs torch.distributed.optim.ZeroRedundancyOptimizer
  ZeRO-2  vs FSDP2 fully_shard(reshard_after_forward=False), set_force_sum_reduction_for_comms(True)
            (its AVG reduce-scatter is wrong on gloo)

Inside the same ranks each pair alternates training steps (forward, backward, AdamW step) and
reports median step times and the bytes each rank holds at the end of the last backward
(optimizer state allocated) in parameters, gradients, fp32 masters and optimizer state, as
visible from Python (torch's DDP gradients are views into its buckets, so those count; other
internal communication buffers do not). The ratios peer / fastpar are the result; CPU absolute times are noise.
Run:  pytest bench/test_bench_ddp_zero.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import BATCH, HIDDEN, ITERS, mlp_model, visible_bytes
from torch import nn

from fastpar.parallel import DistributedDataParallel
from fastpar.testing import run_ranks
from fastpar.zero import ZeroOptimizer


def _setup(kind: str):
    model = mlp_model()
    if kind == "fastpar-ddp":
        wrapped = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return (
            wrapped,
            opt,
            lambda: visible_bytes(model, opt),
        )
    if kind == "torch-ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return (
            wrapped,
            opt,
            lambda: visible_bytes(model, opt),
        )
    if kind in ("fastpar-zero1", "fastpar-zero2"):
        # like the peers: no per-step inf check / global norm (check_gradients=False)
        opt = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-4),
            stage=int(kind[-1]),
            check_gradients=False,
        )
        return model, opt, lambda: opt.memory_bytes()["total"]
    if kind == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4
        )
        return (
            wrapped,
            opt,
            lambda: visible_bytes(model, opt),
        )
    if kind == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        model.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return (
            model,
            opt,
            lambda: visible_bytes(model, opt),
        )
    raise ValueError(kind)


def _side_by_side(ours: str, theirs: str) -> dict:
    rank = dist.get_rank()
    setups = {k: _setup(k) for k in (ours, theirs)}
    x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(rank))
    times = {k: [] for k in setups}
    held = {}
    for it in range(ITERS + 1):
        for k, (model, opt, measure) in setups.items():
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x), torch.zeros_like(x))
            loss.backward()
            if it == ITERS:  # after backward, state allocated: everything a step needs is live
                held[k] = measure()
            opt.step()
            opt.zero_grad()
            if isinstance(model, DistributedDataParallel):
                model.zero_grad()
            if it:  # the first step allocates optimizer state
                times[k].append(time.perf_counter() - t0)
    return {k: {"seconds": statistics.median(times[k]), "bytes": held[k]} for k in setups}


PAIRS = [
    ("fastpar-ddp", "torch-ddp"),
    ("fastpar-zero1", "torch-zero1"),
    ("fastpar-zero2", "torch-fsdp2"),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_against_pytorch_peer(benchmark, world, ours, theirs):
    benchmark.group = f"dp-{ours}-{world}"
    res = benchmark.pedantic(
        run_ranks, args=(_side_by_side, world, ours, theirs), rounds=1, iterations=1
    )
    t = {k: statistics.median(r[k]["seconds"] for r in res) for k in (ours, theirs)}
    mem = {k: max(r[k]["bytes"] for r in res) for k in (ours, theirs)}
    benchmark.extra_info.update(
        seconds=t,
        bytes_per_rank=mem,
        peer_time_over_fastpar=t[theirs] / t[ours],
        peer_bytes_over_fastpar=mem[theirs] / mem[ours],
    )
    print(
        f"\nDP={world} {ours} vs {theirs}: step {t[ours] * 1e3:.1f} vs {t[theirs] * 1e3:.1f} ms "
        f"(peer/fastpar {t[theirs] / t[ours]:.2f}); bytes/rank {mem[ours] / 2**20:.2f} vs "
        f"{mem[theirs] / 2**20:.2f} MiB (peer/fastpar {mem[theirs] / mem[ours]:.2f})"
    )


def _planned_vs_held(stage: int) -> dict:
    """A real model (6-layer transformer encoder, fp32): bytes held per rank and bytes sent per
    step, beside the planner (fastpar layout) and the paper's 2Ψ."""
    from fastpar.zero import estimate_memory, held_bytes

    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True), 6)
    psi = sum(p.numel() for p in model.parameters())
    n = dist.get_world_size()
    x = torch.randn(2, 16, 128)
    if stage == 0:
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters())
        ddp(x).sum().backward()
        opt.step()
        held = held_bytes(model.parameters(), opt)
        plan = estimate_memory(
            psi, n, 0, param_bytes=4, grad_bytes=4, optimizer_bytes=8, mode="fastpar"
        )
        sent = ddp.comm_bytes
    else:
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), stage=stage)
        model(x).sum().backward()
        opt.step()
        held = opt.memory_bytes()
        numels = [b.numel for b in opt.buckets]
        plan = estimate_memory(
            psi,
            n,
            stage,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=8,
            mode="fastpar",
            bucket_numels=numels,
        )
        sent = opt.comm_bytes
    return {"psi": psi, "held": held, "plan_total": plan.total, "sent": sent}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_and_traffic_planned_vs_measured(benchmark, stage):
    world = 4
    benchmark.group = "zero-memory-planned-vs-measured"
    res = benchmark.pedantic(
        run_ranks, args=(_planned_vs_held, world, stage), rounds=1, iterations=1
    )
    r = res[0]
    two_psi = 2 * (world - 1) / world * r["psi"] * 4
    benchmark.extra_info.update(
        stage=stage,
        psi=r["psi"],
        held=r["held"],
        planned_total=r["plan_total"],
        sent_bytes=r["sent"],
        two_psi_bytes=two_psi,
    )
    print(
        f"\nstage {stage}, DP={world}, Ψ={r['psi']:,}: held {r['held']['total'] / 2**20:.2f} MiB "
        f"(params {r['held']['params'] / 2**20:.2f}, grads {r['held']['grads'] / 2**20:.2f}, "
        f"optimizer {r['held']['optimizer'] / 2**20:.2f}); planned {r['plan_total'] / 2**20:.2f} MiB; "
        f"sent {r['sent'] / 2**20:.2f} MiB per step vs 2(N-1)/N·Ψ·4 B = {two_psi / 2**20:.2f} MiB"
    )
