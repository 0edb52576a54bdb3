"""Pipeline parallelism, measured: the bubble, activation memory, and fastpar's GPipe / 1F1B
against torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B over gloo.

* Bubble: every stage costs the same (a forward sleeps F ms, a backward 2F ms, so CPU
  contention does not blur it); each rank's idle fraction = 1 - busy / wall of a step, beside
  (p - 1) / (m + p - 1).
* Activation memory: peak bytes of stored activations on the first stage (tensors saved for
  backward + stage inputs) for GPipe, GPipe + recomputation and 1F1B.
* Peers: the same 4-block MLP chain, step time side by side in one run (ratio).
Run:  pytest bench/test_bench_pipeline.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import pipelines_side_by_side
from torch import nn

from fastpar import ParallelMesh
from fastpar.parallel.pipeline import GPipe, OneFOneB, PipelineEngine, build_stage
from fastpar.testing import run_ranks

FORWARD_S = 0.004


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(FORWARD_S)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * FORWARD_S)
        return g


class SleepStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return _Sleep.apply(x * self.w)


def _bubble(schedule: str, m: int) -> float:
    mesh = ParallelMesh(pp=dist.get_world_size())
    sched = GPipe(m) if schedule == "gpipe" else OneFOneB(m)
    engine = PipelineEngine(
        SleepStage(), mesh, sched, loss_fn=lambda out, y: (out - y).pow(2).mean()
    )
    x = torch.randn(m * 2, 8)
    idle = []
    for _ in range(3):
        engine.train_step(x, x)
        idle.append(1 - engine.stats["busy_s"] / engine.stats["wall_s"])
    return statistics.median(idle)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4])
def test_bubble_table(benchmark, p, schedule):
    benchmark.group = f"pipeline-bubble-{schedule}"
    rows = {}

    def measure():
        for m in (1, 2, 4, 8, 16):
            rows[m] = run_ranks(_bubble, p, schedule, m)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    lines = [f"\n{schedule}, p={p}:  m   measured idle (mean over ranks)   (p-1)/(m+p-1)"]
    table = {}
    for m, idle in rows.items():
        theory = (p - 1) / (m + p - 1)
        table[m] = {"measured": statistics.mean(idle), "theory": theory, "per_rank": idle}
        lines.append(f"{' ' * 14}{m:>3}   {statistics.mean(idle):>8.3f}   {theory:>22.3f}")
    benchmark.extra_info["bubble"] = table
    print("\n".join(lines))


def _mlp_blocks(n=4, h=256):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)) for _ in range(n)]


def _activation_memory(schedule: str, recompute: bool) -> int:
    mesh = ParallelMesh(pp=dist.get_world_size())
    stage, _ = build_stage(_mlp_blocks(), mesh.pp_size, mesh.pp_rank)
    sched = GPipe(8) if schedule == "gpipe" else OneFOneB(8)
    engine = PipelineEngine(
        stage, mesh, sched, loss_fn=F.mse_loss, recompute=recompute, measure_activations=True
    )
    x = torch.randn(64, 256)
    engine.train_step(x, x)
    return engine.stats["peak_activation_bytes"]


@pytest.mark.parametrize("schedule,recompute", [("gpipe", False), ("gpipe", True), ("1f1b", False)])
def test_activation_memory(benchmark, schedule, recompute):
    benchmark.group = "pipeline-activation-memory"
    peaks = benchmark.pedantic(
        run_ranks, args=(_activation_memory, 4, schedule, recompute), rounds=1, iterations=1
    )
    benchmark.extra_info.update(peak_bytes_per_rank=peaks)
    name = schedule + (" + recompute" if recompute else "")
    print(
        f"\n{name:<18} p=4 m=8: peak stored activations per rank (KiB) {[b // 1024 for b in peaks]}"
    )


def _vs_torch(schedule: str, iters: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = ParallelMesh(pp=dist.get_world_size())
    m, x = 8, torch.randn(64, 256)
    ours_stage, _ = build_stage(_mlp_blocks(), mesh.pp_size, mesh.pp_rank)
    ours = PipelineEngine(
        ours_stage, mesh, GPipe(m) if schedule == "gpipe" else OneFOneB(m), loss_fn=F.mse_loss
    )
    theirs_stage, _ = build_stage(_mlp_blocks(), mesh.pp_size, mesh.pp_rank)
    pstage = PipelineStage(theirs_stage, mesh.pp_rank, mesh.pp_size, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    theirs = cls(pstage, n_microbatches=m, loss_fn=F.mse_loss)

    return pipelines_side_by_side(mesh, ours, theirs, x, iters)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4])
def test_against_torch_pipelining(benchmark, p, schedule):
    benchmark.group = f"pipeline-vs-torch-{schedule}"
    res = benchmark.pedantic(run_ranks, args=(_vs_torch, p, schedule, 5), rounds=1, iterations=1)
    t = {k: statistics.median(r[k] for r in res) for k in ("fastpar", "torch")}
    benchmark.extra_info.update(seconds=t, torch_over_fastpar=t["torch"] / t["fastpar"])
    print(
        f"\n{schedule} p={p} m=8: fastpar {t['fastpar'] * 1e3:.1f} ms, torch.distributed.pipelining "
        f"{t['torch'] * 1e3:.1f} ms (torch/fastpar {t['torch'] / t['fastpar']:.2f})"
    )
