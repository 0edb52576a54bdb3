"""End-to-end training step throughput of the default GPT on CPU ranks, for several layouts of
the same 8 ranks (tokens per second, side by side in one run; absolute CPU numbers are noise,
compare the layouts). Run:  pytest bench/test_bench_train.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics

import pytest

from fastpar.train import TrainConfig, launch

LAYOUTS = {
    "dp8": dict(tp=1, pp=1, dp=8, ep=1, moe_every=0, zero=0),
    "dp8-zero2": dict(tp=1, pp=1, dp=8, ep=1, moe_every=0, zero=2),
    "tp2-pp2-dp2": dict(tp=2, pp=2, dp=2, ep=1, moe_every=0, zero=1),
    "tp2-pp2-dp2-ep2": dict(tp=2, pp=2, dp=2, ep=2, zero=1),
    "pp4-dp2-1f1b": dict(tp=1, pp=4, dp=2, ep=1, moe_every=0, zero=1, microbatches=4),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_train_step_throughput(benchmark, name):
    cfg = TrainConfig.from_flags(steps=6, quiet=True, **LAYOUTS[name])
    benchmark.group = "train-step"
    records = benchmark.pedantic(launch, args=(cfg,), rounds=1, iterations=1)
    secs = statistics.median(r["seconds"] for r in records[1:])
    tps = cfg.batch_size * cfg.model.seq_len / secs
    benchmark.extra_info.update(step_seconds=secs, tokens_per_second=tps, layout=name)
    print(f"\n{name}: {secs * 1e3:.0f} ms/step, {tps:,.0f} tokens/s (8 CPU ranks)")
