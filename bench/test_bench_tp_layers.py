"""Tensor-parallel MLP (column -> GELU -> row): fastpar against DTensor's ColwiseParallel /
RowwiseParallel, over gloo on CPU ranks, measured side by side inside the same ranks.

Each rank times forward+backward of both implementations, alternating, and the benchmark
reports the median of each and their ratio (extra_info). Absolute CPU times are noise; the
ratio is the result.  Run:  pytest bench/test_bench_tp_layers.py --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastpar.nn import ColumnParallelLinear, RowParallelLinear
from fastpar.testing import run_ranks


class _MLP(nn.Module):
    def __init__(self, fc: nn.Module, proj: nn.Module):
        super().__init__()
        self.fc, self.proj = fc, proj

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def _time(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _side_by_side(hidden: int, tokens: int, iters: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    torch.manual_seed(0)
    dense = _MLP(nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden))
    ours = _MLP(ColumnParallelLinear.from_dense(dense.fc), RowParallelLinear.from_dense(dense.proj))
    mesh = init_device_mesh("cpu", (world,))
    theirs = parallelize_module(
        _MLP(nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)),
        mesh,
        {"fc": ColwiseParallel(), "proj": RowwiseParallel()},
    )
    x = torch.randn(tokens, hidden)

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        return run

    for m in (ours, theirs):  # warm-up
        step(m)()
    t_ours, t_theirs = [], []
    for _ in range(iters):
        t_ours += _time(step(ours), 1)
        t_theirs += _time(step(theirs), 1)
    return {"fastpar": statistics.median(t_ours), "dtensor": statistics.median(t_theirs)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("hidden,tokens", [(256, 512), (512, 1024)])
def test_mlp_fastpar_vs_dtensor(benchmark, world, hidden, tokens):
    benchmark.group = f"tp-mlp-{world}-ranks"
    results = benchmark.pedantic(
        run_ranks, args=(_side_by_side, world, hidden, tokens, 10), rounds=1, iterations=1
    )
    ours = statistics.median(r["fastpar"] for r in results)
    theirs = statistics.median(r["dtensor"] for r in results)
    benchmark.extra_info.update(
        fastpar_ms=ours * 1e3, dtensor_ms=theirs * 1e3, dtensor_over_fastpar=theirs / ours
    )
    print(
        f"\nTP={world} h={hidden} tokens={tokens}: fastpar {ours * 1e3:.2f} ms, "
        f"DTensor {theirs * 1e3:.2f} ms, DTensor/fastpar = {theirs / ours:.2f}"
    )
