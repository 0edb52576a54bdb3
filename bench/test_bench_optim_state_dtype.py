"""bf16 optimizer state against fp32, side by side: ``FusedAdamW(state_dtype=torch.bfloat16)``.

* ``test_state_bytes_and_step_time[stage]``: the data-parallel family (``Replicate`` at stage 0,
  ``Shard`` at 1-3) on 2 CPU ranks (gloo) around the 4 x Linear(512, 512) chain of the other
  data-parallel benchmarks, fp32 parameters (the master is the parameter buffer: the state is
  the two moments and one 0-dim "step" per flat). In the same ranks the two wrappers alternate
  training steps; per rank: the optimizer state's bytes (sum of its tensors' nbytes) of each,
  the planner's (``estimate_memory(optimizer_bytes=adamw_state_bytes(...))``) and the median step
  time. The moments' bytes halve exactly (asserted); the step times are a ratio on one machine.
* ``test_fused_adamw_step[N1M]``: one process, one ``FusedAdamW.step`` over 1M fp32 parameters
  with fp32 or bf16 moments, alternated: bytes moved per step 16 + 2·4 = 24 vs 16 + 2·2 = 20
  per parameter on a streaming kernel (read p, g, m, v; write p, m, v), the time ratio.

Run:  pytest bench/test_bench_optim_state_dtype.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from _common import BATCH, HIDDEN, ITERS, mlp_model
from torch import nn

from fastpar.optim import FusedAdamW
from fastpar.parallel import Replicate, Shard
from fastpar.testing import run_ranks
from fastpar.zero import adamw_state_bytes, estimate_memory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _wrap(stage: int, state_dtype: torch.dtype):
    adamw = lambda ps: FusedAdamW(ps, lr=1e-4, state_dtype=state_dtype)  # noqa: E731
    if stage == 0:
        return Replicate(mlp_model(), adamw)
    unit = {"wrap": (nn.Linear,)} if stage == 3 else {}
    return Shard(mlp_model(), adamw, stage=stage, **unit)


def _side_by_side(stage: int) -> dict:
    x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    wrappers = {k: _wrap(stage, d) for k, d in DTYPES.items()}
    seconds = {k: [] for k in DTYPES}
    for _ in range(ITERS + 1):  # the first step allocates the state: not timed
        for k, w in wrappers.items():
            t0 = time.perf_counter()
            F.mse_loss(w(x), x).backward()
            w.step()
            w.zero_grad()
            seconds[k].append(time.perf_counter() - t0)
    world = torch.distributed.get_world_size()
    out = {}
    for k, w in wrappers.items():
        states = list(w.optimizer.state.values())
        steps = sum(st["step"].nbytes for st in states)
        numels = [f.bucket.numel for f in w.flats]
        plan = estimate_memory(
            sum(numels),
            world,
            stage,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=adamw_state_bytes(DTYPES[k], master=False),
            mode="fastpar",
            bucket_numels=numels,
        )
        out[k] = {
            "state_bytes": w.memory_bytes()["optimizer"],
            "step_bytes": steps,
            "planned": plan.optimizer,
            "total_bytes": w.memory_bytes()["total"],
            "seconds": statistics.median(seconds[k][1:]),
        }
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_and_step_time(benchmark, stage):
    world = 2
    benchmark.group = f"optim-state-dtype-zero{stage}-{world}"
    res = benchmark.pedantic(run_ranks, args=(_side_by_side, world, stage), rounds=1, iterations=1)
    for r in res:
        for k in DTYPES:
            assert r[k]["state_bytes"] - r[k]["step_bytes"] == r[k]["planned"], (k, r[k])
        moments = {k: r[k]["state_bytes"] - r[k]["step_bytes"] for k in DTYPES}
        assert 2 * moments["bf16"] == moments["fp32"]
    r = res[0]
    t = {k: statistics.median(x[k]["seconds"] for x in res) for k in DTYPES}
    benchmark.extra_info.update(
        stage=stage,
        world=world,
        state_bytes_per_rank={k: r[k]["state_bytes"] for k in DTYPES},
        total_bytes_per_rank={k: r[k]["total_bytes"] for k in DTYPES},
        state_ratio=r["bf16"]["state_bytes"] / r["fp32"]["state_bytes"],
        seconds=t,
        bf16_time_over_fp32=t["bf16"] / t["fp32"],
    )
    print(
        f"\nZeRO-{stage} DP={world}: optimizer state per rank {r['fp32']['state_bytes']:,} B fp32 "
        f"vs {r['bf16']['state_bytes']:,} B bf16 (ratio "
        f"{r['bf16']['state_bytes'] / r['fp32']['state_bytes']:.4f}; planned "
        f"{r['fp32']['planned']:,} / {r['bf16']['planned']:,} + steps "
        f"{r['bf16']['step_bytes']} B); all held {r['fp32']['total_bytes']:,} vs "
        f"{r['bf16']['total_bytes']:,} B; step {t['fp32'] * 1e3:.1f} vs {t['bf16'] * 1e3:.1f} ms "
        f"(bf16/fp32 {t['bf16'] / t['fp32']:.2f})"
    )


@pytest.mark.parametrize("numel", [1_000_000], ids=["N1M"])
def test_fused_adamw_step(benchmark, numel):
    gen = torch.Generator().manual_seed(0)
    setups = {}
    for k, d in DTYPES.items():
        p = nn.Parameter(torch.randn(numel, generator=gen))
        p.grad = torch.randn(numel, generator=gen) * 1e-2
        opt = FusedAdamW([p], lr=1e-4, state_dtype=d)
        opt.step()  # allocates the state
        setups[k] = opt
    seconds = {k: [] for k in DTYPES}

    def run():
        for k, opt in setups.items():
            t0 = time.perf_counter()
            opt.step()
            seconds[k].append(time.perf_counter() - t0)

    benchmark.group = f"optim-state-dtype-step-N{numel // 1_000_000}M"
    benchmark.pedantic(run, rounds=10, warmup_rounds=1, iterations=1)
    t = {k: statistics.median(v) for k, v in seconds.items()}
    moved = {"fp32": 24 * numel, "bf16": 20 * numel}
    benchmark.extra_info.update(
        numel=numel, seconds=t, compulsory_bytes=moved, bf16_time_over_fp32=t["bf16"] / t["fp32"]
    )
    print(
        f"\nFusedAdamW.step, {numel:,} params: fp32 state {t['fp32'] * 1e3:.2f} ms, bf16 state "
        f"{t['bf16'] * 1e3:.2f} ms (bf16/fp32 {t['bf16'] / t['fp32']:.2f}; compulsory bytes "
        f"{moved['bf16'] / moved['fp32']:.3f} of fp32's)"
    )
