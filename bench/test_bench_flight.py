"""The flight recorder's cost (docs/debugging.md): the training step with it on (the default:
torch's recorder on every group, fastpar's ring of shapes, split sizes and pipeline messages)
and off (``FASTPAR_FLIGHT=0``: both off), side by side in one run, alternating on / off so
that drift on a busy machine falls on both alike; and the cost per collective of a small
all-reduce. Absolute CPU times are noise: compare the columns. Run:
    pytest bench/test_bench_flight.py -s --benchmark-json=bench/results/flight.json
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.comm import reduce_from_region
from fastpar.launch import run_ranks
from fastpar.train import TrainConfig, launch

LAYOUTS = {  # 2 ranks: tensor parallel (all-reduces and gathers), expert parallel (all-to-alls)
    "tp2": dict(tp=2, pp=1, dp=1, ep=1, moe_every=0),
    "dp2-ep2": dict(tp=1, pp=1, dp=2, ep=2, moe_every=1),
    "pp2": dict(tp=1, pp=2, dp=1, ep=1, moe_every=0, microbatches=4),
}
ROUNDS = 3


def _with(flag: str, fn, *args, **kwargs):
    old = os.environ.get("FASTPAR_FLIGHT")
    os.environ["FASTPAR_FLIGHT"] = flag  # read again in each forked rank
    try:
        return fn(*args, **kwargs)
    finally:
        if old is None:
            os.environ.pop("FASTPAR_FLIGHT", None)
        else:
            os.environ["FASTPAR_FLIGHT"] = old


def _step_seconds(cfg) -> float:
    records = launch(cfg)
    return statistics.median(r["seconds"] for r in records[2:])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_train_step_with_and_without_the_recorder(benchmark, name):
    cfg = TrainConfig.from_flags(steps=8, quiet=True, **LAYOUTS[name])
    benchmark.group = "flight-train-step"
    on, off = [], []

    def both():
        for _ in range(ROUNDS):
            off.append(_with("0", _step_seconds, cfg))
            on.append(_with("1", _step_seconds, cfg))

    benchmark.pedantic(both, rounds=1, iterations=1)
    s_on, s_off = statistics.median(on), statistics.median(off)
    benchmark.extra_info.update(layout=name, step_s_on=s_on, step_s_off=s_off, ratio=s_on / s_off)
    print(
        f"\n{name}: recorder on {s_on * 1e3:.1f} ms/step, off {s_off * 1e3:.1f} ms/step, "
        f"on/off {s_on / s_off:.3f} (rounds on {[round(x * 1e3, 1) for x in on]}, "
        f"off {[round(x * 1e3, 1) for x in off]})"
    )


def _per_collective(n: int) -> float:
    x = torch.ones(16)
    for _ in range(100):
        reduce_from_region(x)
    t0 = time.perf_counter()
    for _ in range(n):
        reduce_from_region(x)
    dist.barrier()
    return (time.perf_counter() - t0) / n


def test_cost_per_collective(benchmark):
    """A 16-float all-reduce through fastpar's comm layer on 2 ranks (a note in the ring and
    an entry in torch's recorder each), on and off alternately."""
    benchmark.group = "flight-collective"
    on, off = [], []

    def both():
        for _ in range(ROUNDS):
            off.append(max(_with("0", run_ranks, _per_collective, 2, 3000, timeout=120)))
            on.append(max(_with("1", run_ranks, _per_collective, 2, 3000, timeout=120)))

    benchmark.pedantic(both, rounds=1, iterations=1)
    us_on, us_off = statistics.median(on) * 1e6, statistics.median(off) * 1e6
    benchmark.extra_info.update(us_on=us_on, us_off=us_off)
    print(
        f"\nall-reduce of 16 floats: on {us_on:.1f} us, off {us_off:.1f} us, +{us_on - us_off:.1f} us"
    )


def _interleaved(cfg, tokens, steps: int):
    from fastpar.flight.record import SWITCH
    from fastpar.mesh import ParallelMesh
    from fastpar.train.build import Trainer

    mesh = ParallelMesh(cfg.tp, cfg.pp, cfg.ep, cp=cfg.cp)
    trainer = Trainer(cfg, mesh, torch.device("cpu"), tokens)
    for _ in range(3):
        trainer.step()
    times = {True: [], False: []}
    for i in range(steps):
        flag = bool(i % 2)
        SWITCH.set(flag)
        dist.barrier()
        t0 = time.perf_counter()
        rec = trainer.step()
        float(rec["grad_norm"])
        times[flag].append(time.perf_counter() - t0)
    return statistics.median(times[True]), statistics.median(times[False])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_notes_on_and_off_step_by_step(benchmark, name):
    """fastpar's own notes (the ring) on and off every other step in the same ranks (torch's
    recorder on throughout): the cleanest A/B on a busy machine."""
    from fastpar.train.batches import load_data

    cfg = TrainConfig.from_flags(steps=40, quiet=True, **LAYOUTS[name])
    benchmark.group = "flight-notes"
    out = benchmark.pedantic(
        run_ranks,
        args=(_interleaved, 2, cfg, load_data(cfg), 40),
        kwargs=dict(timeout=300),
        rounds=1,
        iterations=1,
    )
    on, off = max(r[0] for r in out), max(r[1] for r in out)
    benchmark.extra_info.update(layout=name, step_s_on=on, step_s_off=off, ratio=on / off)
    print(
        f"\n{name}: notes on {on * 1e3:.2f} ms/step, off {off * 1e3:.2f} ms/step, on/off {on / off:.3f}"
    )
