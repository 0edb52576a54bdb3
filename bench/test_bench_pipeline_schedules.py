"""Pipeline schedules side by side: the bubble of GPipe, 1F1B, interleaved 1F1B (v = 2, 4) and
zero-bubble ZB-H1 measured on CPU ranks beside theory, peak activation memory per rank, and
step time against torch.distributed.pipelining's ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble.

* Bubble: compute per micro-batch is a fixed cost, not CPU work (2 cores cannot run 4 ranks'
  matmuls without contention): each rank's stage forward sleeps FORWARD_S and its backward
  2 * FORWARD_S, split evenly over its v chunks (a chunk sleeps FORWARD_S / v, 2 FORWARD_S / v),
  so every schedule does the same work per rank. ZB-H1 splits each backward into B (input
  gradient) and W (weight gradient), so the fixed cost is split too, half each: the chunk's
  activation path sleeps FORWARD_S in backward (it runs in B; on the first stage, whose input
  needs no gradient, in W) and a node on the path to a second weight only sleeps FORWARD_S (it
  runs in W); unsplit, one backward runs both, 2 FORWARD_S as before. ZB-H1's theory: (p - 1) / (3 m + p - 1) (unit
  costs F = B = W; 1F1B's (p - 1) / (m + p - 1) is the same costs unsplit). The engine's ``stats`` give the busy seconds
  (inside forwards and backwards); the wall is the step's makespan, from a barrier before it
  to a barrier after it (the same on every rank); idle = 1 - busy / wall, the median of 5
  steps after one warm-up step (it agrees the message shapes and opens gloo's pairs),
  averaged over ranks, beside (p - 1) / (v m + p - 1). The idle is split, from the same
  ``stats``, into ``wait`` (inside receives: waiting for a peer — the schedule's bubble plus
  the hops of messages), ``host`` (posting sends and early receives: a per-message cost that
  theory, with free messages, does not have) and ``rest`` (a rank's idle after its last
  action — the cool-down bubble of GPipe and 1F1B lands there — the step's fixed costs and
  the Python between actions). ``fixed`` = 1 - span / wall: the step's fixed costs (loss
  broadcast, last sends, barriers, set-up), where the span runs from the first action's
  start to the last action's end over all ranks; ``span_idle`` = 1 - busy / span is the
  bubble over that span, what the simulator's makespan models. ``ideal_idle`` =
  1 - 3 m FORWARD_S / wall counts the sleeps' overshoot and autograd's own time as idle too.
  Interleaved runs in Megatron's groups of p micro-batches and, as ``-g2p``, in groups of 2p
  (``group_size``: slack around the ring that absorbs each message's latency, m >= 2p).
  Beside torch: the same sleep chunks under torch.distributed.pipelining's
  ScheduleInterleaved1F1B on the same ranks, steps alternating, each schedule's idle as
  1 - 3 m FORWARD_S / step (``_bubble_beside_torch``).
* Activation memory: a 16-block MLP chain (h = 256, batch 64, m = 8, p = 4), the peak bytes of
  stored activations per rank (stage inputs + tensors autograd saved), every schedule.
* Peer: the same 8-block MLP chain cut into p * 2 chunks, fastpar's Interleaved(8, 2) and
  torch's ScheduleInterleaved1F1B(n_microbatches=8) on the same ranks, median step time, ratio;
  and cut into p stages, fastpar's ZeroBubbleH1(8) beside torch's ScheduleInterleavedZeroBubble
  (one stage per rank: torch's closest zero-bubble schedule to ZB-H1).
Run:  pytest bench/test_bench_pipeline_schedules.py -s --benchmark-json=...
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import median_step_times, pipelines_side_by_side, torch_pipeline_step
from torch import nn

from fastpar import ParallelMesh
from fastpar.parallel.pipeline import (
    GPipe,
    Interleaved,
    OneFOneB,
    PipelineEngine,
    ZeroBubbleH1,
    build_stage,
    build_virtual_stages,
)
from fastpar.testing import run_ranks

#: one rank's stage forward (backward 2x); FASTPAR_BENCH_FORWARD_S overrides it. Each
#: action also pays a gloo p2p latency (~0.2-0.3 ms on 2 loaded cores) that sits on the
#: critical path of the steady phase: it counts as idle, relatively more the shorter a
#: chunk's work (v = 4 at 8 ms splits the work into 2 ms forwards), so longer costs measure
#: the schedule's own bubble more closely
FORWARD_S = float(os.environ.get("FASTPAR_BENCH_FORWARD_S", "0.008"))


class _Sleep(torch.autograd.Function):
    """Forward sleeps ``seconds``, backward ``back`` (default twice as long)."""

    @staticmethod
    def forward(ctx, x, seconds, back=None):
        ctx.back = 2 * seconds if back is None else back
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.back)
        return g, None, None


class _SleepInBackward(torch.autograd.Function):
    """Identity; its backward sleeps ``seconds``."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class SleepChunk(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.w = seconds, nn.Parameter(torch.ones(1))

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.seconds)


class SplitSleepChunk(SleepChunk):
    """Forward ``seconds``; backward ``seconds`` on the activation path (B; on the first stage,
    whose input needs no gradient, it lies on the path to ``w`` only, so it runs in W) and
    ``seconds`` on the path to ``v`` only (W): 2 ``seconds`` when the backward is not split."""

    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.v = nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = _Sleep.apply(x * self.w, self.seconds, self.seconds)
        return h * _SleepInBackward.apply(self.v, self.seconds)


def _schedule(name: str, m: int, v: int, group: int | None = None):
    if name == "interleaved":
        return Interleaved(m, v, group)
    return {"gpipe": GPipe, "1f1b": OneFOneB, "zb-h1": ZeroBubbleH1}[name](m)


def _bubble(name: str, m: int, v: int, group: int | None = None) -> float:
    mesh = ParallelMesh(pp=dist.get_world_size())
    sched = _schedule(name, m, v, group)
    kind = SplitSleepChunk if sched.splits_backward else SleepChunk
    chunks = [kind(FORWARD_S / v) for _ in range(v)]
    stage = chunks if v > 1 else chunks[0]
    engine = PipelineEngine(stage, mesh, sched, loss_fn=lambda out, y: (out - y).pow(2).mean())
    x = torch.randn(m * 2, 8)
    rows = []
    for it in range(6):  # the makespan of a step: from a barrier to a barrier after it
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(x, x)
        dist.barrier()
        wall, st = time.perf_counter() - t0, engine.stats
        # the schedule's span: the first action's start to the last action's end, any rank
        # (perf_counter is one clock for every process of this machine)
        ends = torch.tensor([-st["actions_s"][0], st["actions_s"][1]], dtype=torch.float64)
        dist.all_reduce(ends, op=dist.ReduceOp.MAX)
        span = float(ends.sum())
        if it:  # the first step is a warm-up
            rows.append(
                {
                    "idle": 1 - st["busy_s"] / wall,
                    "wait": st["recv_s"] / wall,
                    "host": st["send_s"] / wall,
                    "ideal_idle": 1 - 3 * m * FORWARD_S / wall,
                    "span_idle": 1 - st["busy_s"] / span,
                    "fixed": 1 - span / wall,
                    "wall_s": wall,
                }
            )
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["rest"] = out["idle"] - out["wait"] - out["host"]
    return out


#: (schedule, v, micro-batch groups of 2p: interleaved's slack against message latency)
CASES = [
    ("gpipe", 1, False),
    ("1f1b", 1, False),
    ("interleaved", 2, False),
    ("interleaved", 4, False),
    ("interleaved", 2, True),
    ("interleaved", 4, True),
    ("zb-h1", 1, False),
]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize(
    "name,v,wide", CASES, ids=[f"{n}-v{v}" + ("-g2p" if w else "") for n, v, w in CASES]
)
def test_bubble_against_theory(benchmark, name, v, wide, p):
    benchmark.group = f"pipeline-schedule-bubble-p{p}"
    rows = {}

    def measure():
        for m in (2 * p, 4 * p) if wide else (p, 2 * p, 4 * p):
            rows[m] = run_ranks(_bubble, p, name, m, v, 2 * p if wide else None)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    label = name + (f" v={v}" if v > 1 else "") + (f" G={2 * p}" if wide else "")
    lines = [
        f"\n{label}, p={p}:   m   measured idle   theory   measured/theory   1F1B theory"
        "    wait    host    rest   fixed   span idle   ideal idle   step ms"
    ]
    table = {}
    for m, per_rank in rows.items():
        theory = _schedule(name, m, v).theory(p)
        mean = {k: statistics.mean(r[k] for r in per_rank) for k in per_rank[0]}
        got = mean["idle"]
        one = OneFOneB(m).theory(p)
        table[m] = {
            "measured": got,
            "theory": theory,
            "ratio": got / theory,
            "per_rank": [r["idle"] for r in per_rank],
            "1f1b_theory": one,
            **{
                k: mean[k]
                for k in ("wait", "host", "rest", "fixed", "span_idle", "ideal_idle", "wall_s")
            },
        }
        lines.append(
            f"{' ' * 16}{m:>3}   {got:>13.3f}   {theory:>6.3f}   {got / theory:>15.2f}"
            f"   {one:>11.3f}   {mean['wait']:.3f}   {mean['host']:.3f}   "
            f"{mean['rest']:.3f}   {mean['fixed']:.3f}   {mean['span_idle']:>9.3f}   "
            f"{mean['ideal_idle']:>10.3f}   {mean['wall_s'] * 1e3:>7.1f}"
        )
    benchmark.extra_info["bubble"] = table
    print("\n".join(lines))


def _bubble_beside_torch(v: int, m: int, steps: int = 5) -> dict[str, float]:
    """The same sleep chunks under fastpar's Interleaved (groups of p, and of 2p) and torch's
    ScheduleInterleaved1F1B on these ranks, steps alternating between barriers; each one's
    idle as 1 - 3 m FORWARD_S / step (every rank sleeps the same 3 m FORWARD_S a step under
    each, so the three are measured alike)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    mesh = ParallelMesh(pp=dist.get_world_size())
    p, r = mesh.pp_size, mesh.pp_rank
    loss = lambda out, y: (out - y).pow(2).mean()  # noqa: E731 - torch takes it by position
    x = torch.randn(m * 2, 8)
    ours = {
        f"fastpar G={g}": PipelineEngine(
            [SleepChunk(FORWARD_S / v) for _ in range(v)], mesh, Interleaved(m, v, g), loss_fn=loss
        )
        for g in (p, 2 * p)
    }
    stages = [
        PipelineStage(SleepChunk(FORWARD_S / v), c * p + r, p * v, torch.device("cpu"))
        for c in range(v)
    ]
    theirs = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss)

    runs = {
        name: (lambda e=e: e.train_step(x, x, broadcast_loss=False)) for name, e in ours.items()
    }
    runs["torch ScheduleInterleaved1F1B"] = torch_pipeline_step(mesh, theirs, x)
    walls = median_step_times(runs, steps)
    return {name: 1 - 3 * m * FORWARD_S / wall for name, wall in walls.items()}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_bubble_beside_torch(benchmark, v, p):
    """The measured bubble of interleaved 1F1B beside torch.distributed.pipelining's on the
    same chunks and ranks (m = 8): the torch-native peer pays the same per-message costs."""
    benchmark.group = f"pipeline-interleaved-bubble-vs-torch-p{p}"
    res = benchmark.pedantic(
        run_ranks, args=(_bubble_beside_torch, p, v, 8), rounds=1, iterations=1
    )
    idle = {k: statistics.mean(r[k] for r in res) for k in res[0]}
    theory = Interleaved(8, v).theory(p)
    benchmark.extra_info.update(idle=idle, theory=theory)
    print(
        f"\ninterleaved v={v} p={p} m=8, idle (x theory {theory:.3f}): "
        + ", ".join(f"{k} {x:.3f} (x{x / theory:.2f})" for k, x in idle.items())
    )


def _mlp_blocks(n: int = 16, h: int = 256):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)) for _ in range(n)]


def _stage_for(mesh, name: str, v: int, n: int):
    if v > 1:
        return build_virtual_stages(_mlp_blocks(n), mesh.pp_size, mesh.pp_rank, v)[0]
    return build_stage(_mlp_blocks(n), mesh.pp_size, mesh.pp_rank)[0]


def _activation_memory(name: str, v: int, recompute: bool, group: int | None = None) -> int:
    mesh = ParallelMesh(pp=dist.get_world_size())
    engine = PipelineEngine(
        _stage_for(mesh, name, v, 16),
        mesh,
        _schedule(name, 8, v, group),
        loss_fn=F.mse_loss,
        recompute=recompute,
        measure_activations=True,
    )
    x = torch.randn(64, 256)
    engine.train_step(x, x)
    return engine.stats["peak_activation_bytes"]


MEMORY = [
    ("gpipe", 1, False, None),
    ("gpipe", 1, True, None),
    ("1f1b", 1, False, None),
    ("interleaved", 2, False, None),
    ("interleaved", 4, False, None),
    ("interleaved", 2, True, None),
    ("interleaved", 2, False, 8),
    ("interleaved", 4, False, 8),
    ("zb-h1", 1, False, None),
]


@pytest.mark.parametrize(
    "name,v,recompute,group",
    MEMORY,
    ids=[f"{n}-v{v}{'-recompute' if r else ''}{f'-g{g}' if g else ''}" for n, v, r, g in MEMORY],
)
def test_activation_memory_per_rank(benchmark, name, v, recompute, group):
    benchmark.group = "pipeline-schedule-activation-memory"
    peaks = benchmark.pedantic(
        run_ranks, args=(_activation_memory, 4, name, v, recompute, group), rounds=1, iterations=1
    )
    benchmark.extra_info.update(peak_bytes_per_rank=peaks)
    label = name + (f" v={v}" if v > 1 else "") + (" + recompute" if recompute else "")
    label += f" G={group}" if group else ""
    print(
        f"\n{label:<26} p=4 m=8: peak stored activations per rank (KiB) "
        f"{[b // 1024 for b in peaks]}"
    )


def _vs_torch(iters: int, v: int = 2, m: int = 8) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    mesh = ParallelMesh(pp=dist.get_world_size())
    p, r = mesh.pp_size, mesh.pp_rank
    x = torch.randn(64, 256)
    n = 8 if p * v <= 8 else p * v
    ours = PipelineEngine(
        _stage_for(mesh, "interleaved", v, n), mesh, Interleaved(m, v), loss_fn=F.mse_loss
    )
    theirs_chunks = _stage_for(mesh, "interleaved", v, n).chunks
    stages = [
        PipelineStage(chunk, c * p + r, p * v, torch.device("cpu"))
        for c, chunk in enumerate(theirs_chunks)
    ]
    theirs = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=F.mse_loss)

    return pipelines_side_by_side(mesh, ours, theirs, x, iters)


@pytest.mark.parametrize("p", [2, 4])
def test_against_torch_interleaved_1f1b(benchmark, p):
    benchmark.group = "pipeline-vs-torch-interleaved"
    res = benchmark.pedantic(run_ranks, args=(_vs_torch, p, 5), rounds=1, iterations=1)
    _report_vs_torch(benchmark, res, f"interleaved v=2 p={p} m=8", "ScheduleInterleaved1F1B")


def _report_vs_torch(benchmark, res: list[dict], what: str, peer: str) -> None:
    """Median step times of both across ranks, their ratio recorded and printed."""
    t = {k: statistics.median(r[k] for r in res) for k in ("fastpar", "torch")}
    benchmark.extra_info.update(seconds=t, torch_over_fastpar=t["torch"] / t["fastpar"])
    print(
        f"\n{what}: fastpar {t['fastpar'] * 1e3:.1f} ms, torch {peer} {t['torch'] * 1e3:.1f} ms "
        f"(torch/fastpar {t['torch'] / t['fastpar']:.2f})"
    )


def _vs_torch_zb(iters: int, m: int = 8) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

    mesh = ParallelMesh(pp=dist.get_world_size())
    p, r = mesh.pp_size, mesh.pp_rank
    x = torch.randn(64, 256)
    ours = PipelineEngine(
        _stage_for(mesh, "zb-h1", 1, 8), mesh, ZeroBubbleH1(m), loss_fn=F.mse_loss
    )
    stage = PipelineStage(_stage_for(mesh, "zb-h1", 1, 8), r, p, torch.device("cpu"))
    theirs = ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=F.mse_loss)
    return pipelines_side_by_side(mesh, ours, theirs, x, iters)


@pytest.mark.parametrize("p", [2, 4])
def test_against_torch_zero_bubble(benchmark, p):
    benchmark.group = "pipeline-vs-torch-zero-bubble"
    res = benchmark.pedantic(run_ranks, args=(_vs_torch_zb, p, 5), rounds=1, iterations=1)
    _report_vs_torch(benchmark, res, f"zb-h1 p={p} m=8", "ScheduleInterleavedZeroBubble")
