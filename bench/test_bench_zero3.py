"""fastpar ZeRO-3 (``Zero3``) against FSDP2 ``fully_shard`` on CPU ranks (gloo), side by side.

Both shard every ``nn.Linear`` as its own unit (plus the root), reshard after forward, and
reduce-scatter fp32 gradients; FSDP2 is told ``set_force_sum_reduction_for_comms(True)`` (its
AVG reduce-scatter is wrong on gloo; it then divides by N itself). Both must reach the
single-process loss after the last step (checked: equal to the printed digits). Inside the same ranks
the two alternate training steps (forward, backward, AdamW step) and report the median step time
and the bytes each rank holds at the end of the last backward (sharded parameters, gradients,
fp32 masters, optimizer state). The ratios FSDP2 / fastpar are the result; CPU absolute times
are noise. A second test puts the planner (``estimate_memory(stage=3, mode="fastpar")``) beside
the bytes held and the bytes sent per step (3·Ψ·(N-1)/N) for a 6-layer transformer encoder.
Run:  pytest bench/test_bench_zero3.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import BATCH, HIDDEN, ITERS, mlp_model, nbytes
from torch import nn

from fastpar.testing import run_ranks
from fastpar.zero import Zero3, estimate_memory


def _setup(kind: str):
    """(model, step(), zero_grad(), held bytes())."""
    model = mlp_model()
    if kind == "fastpar-zero3":
        z = Zero3(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), wrap=(nn.Linear,))
        return z, z.step, z.zero_grad, lambda: z.memory_bytes()["total"]
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    model.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def held() -> int:
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        params = list(model.parameters())
        return nbytes(params) + nbytes(p.grad for p in params) + nbytes(state)

    return model, opt.step, opt.zero_grad, held


def _side_by_side() -> dict:
    rank = dist.get_rank()
    setups = {k: _setup(k) for k in ("fastpar-zero3", "torch-fsdp2")}
    x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(rank))
    times = {k: [] for k in setups}
    held, sent, losses = {}, {}, {}
    z3 = setups["fastpar-zero3"][0]
    for it in range(ITERS + 1):
        for k, (model, step, zero_grad, measure) in setups.items():
            before = z3.comm_bytes
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x), torch.zeros_like(x))
            loss.backward()
            if it == ITERS:  # after backward, state allocated: everything a step needs is live
                held[k] = measure()
            step()
            zero_grad()
            if it:  # the first step allocates optimizer state
                times[k].append(time.perf_counter() - t0)
            if k == "fastpar-zero3":
                sent[k] = z3.comm_bytes - before
            losses[k] = loss.item()
    return {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "bytes": held,
        "sent": sent["fastpar-zero3"],
        "padded": z3.padded_numel(),
        "peak_gathered": z3.peak_gathered_bytes,
        "losses": losses,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_against_fsdp2(benchmark, world):
    ours, theirs = "fastpar-zero3", "torch-fsdp2"
    benchmark.group = f"zero3-vs-fsdp2-{world}"
    res = benchmark.pedantic(run_ranks, args=(_side_by_side, world), rounds=1, iterations=1)
    t = {k: statistics.median(r["seconds"][k] for r in res) for k in (ours, theirs)}
    mem = {k: max(r["bytes"][k] for r in res) for k in (ours, theirs)}
    three_psi = 3 * res[0]["padded"] * (world - 1) / world * 4
    benchmark.extra_info.update(
        seconds=t,
        bytes_per_rank=mem,
        peer_time_over_fastpar=t[theirs] / t[ours],
        peer_bytes_over_fastpar=mem[theirs] / mem[ours],
        sent_bytes=res[0]["sent"],
        three_psi_bytes=three_psi,
        peak_gathered_bytes=res[0]["peak_gathered"],
    )
    assert res[0]["sent"] == pytest.approx(three_psi)
    for r in res:  # the same training: both reach the same loss after ITERS steps
        assert r["losses"][ours] == pytest.approx(r["losses"][theirs], rel=1e-5)
    print(
        f"\nDP={world} {ours} vs {theirs}: step {t[ours] * 1e3:.1f} vs {t[theirs] * 1e3:.1f} ms "
        f"(peer/fastpar {t[theirs] / t[ours]:.2f}); bytes/rank {mem[ours] / 2**20:.2f} vs "
        f"{mem[theirs] / 2**20:.2f} MiB (peer/fastpar {mem[theirs] / mem[ours]:.2f}); sent "
        f"{res[0]['sent'] / 2**20:.2f} MiB/step = 3(N-1)/N·Ψ·4 B {three_psi / 2**20:.2f} MiB; "
        f"peak gathered {res[0]['peak_gathered'] / 2**20:.2f} MiB"
    )


def _planned_vs_held() -> dict:
    """A 6-layer transformer encoder (fp32), one unit per layer: bytes held per rank and bytes
    sent per step, beside the planner (fastpar layout) and 3Ψ."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(128, 4, 256, batch_first=True), 6, enable_nested_tensor=False
    )
    psi = sum(p.numel() for p in model.parameters())
    n = dist.get_world_size()
    z = Zero3(model, lambda ps: torch.optim.AdamW(ps), wrap=(nn.TransformerEncoderLayer,))
    x = torch.randn(2, 16, 128)
    z(x).sum().backward()
    z.step()
    held = z.memory_bytes()
    plan = estimate_memory(
        psi,
        n,
        3,
        param_bytes=4,
        grad_bytes=4,
        optimizer_bytes=8,
        mode="fastpar",
        bucket_numels=z.flat_numels(),
    )
    return {
        "psi": psi,
        "held": held,
        "plan_total": plan.total,
        "sent": z.comm_bytes,
        "n_flats": len(z.flat_numels()),
        "peak_gathered": z.peak_gathered_bytes,
    }


def test_memory_and_traffic_planned_vs_measured_stage3(benchmark):
    world = 4
    benchmark.group = "zero-memory-planned-vs-measured"
    res = benchmark.pedantic(run_ranks, args=(_planned_vs_held, world), rounds=1, iterations=1)
    r = res[0]
    three_psi = 3 * (world - 1) / world * r["psi"] * 4
    benchmark.extra_info.update(
        stage=3,
        psi=r["psi"],
        held=r["held"],
        planned_total=r["plan_total"],
        sent_bytes=r["sent"],
        three_psi_bytes=three_psi,
        peak_gathered=r["peak_gathered"],
    )
    # beyond the plan: AdamW's 0-dim fp32 "step" per flat buffer
    assert r["held"]["total"] - 4 * r["n_flats"] == r["plan_total"]
    print(
        f"\nstage 3, DP={world}, Ψ={r['psi']:,}: held {r['held']['total'] / 2**20:.3f} MiB "
        f"(params {r['held']['params'] / 2**20:.3f}, grads {r['held']['grads'] / 2**20:.3f}, "
        f"optimizer {r['held']['optimizer'] / 2**20:.3f}); planned "
        f"{r['plan_total'] / 2**20:.3f} MiB; sent {r['sent'] / 2**20:.2f} MiB per step vs "
        f"3(N-1)/N·Ψ·4 B = {three_psi / 2**20:.2f} MiB (padding included in sent); peak "
        f"gathered {r['peak_gathered'] / 2**20:.2f} MiB"
    )
