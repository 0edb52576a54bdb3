"""The MoE layer's step time (forward + backward) over gloo at EP = 1, 2, 4, capacity and
dropless, each rank holding the same number of tokens. On CPU ranks the absolute times are
noise; the ratio EP=n / EP=1 shows what the two all-to-alls cost against the expert compute.
Run:  pytest bench/test_bench_moe_layer.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from fastpar import ParallelMesh
from fastpar.moe import MoE
from fastpar.testing import run_ranks


def _step_time(ep: int, capacity_factor, iters: int = 5) -> float:
    mesh = ParallelMesh(ep=ep)
    torch.manual_seed(0)
    moe = MoE(256, 1024, 8, top_k=2, capacity_factor=capacity_factor, mesh=mesh)
    x = torch.randn(1024, 256)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        moe(x).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


@pytest.mark.parametrize("capacity_factor", [1.25, None], ids=["capacity", "dropless"])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_moe_layer_step(benchmark, ep, capacity_factor):
    benchmark.group = f"moe-layer-{'dropless' if capacity_factor is None else 'capacity'}"
    res = benchmark.pedantic(
        run_ranks, args=(_step_time, ep, ep, capacity_factor), rounds=1, iterations=1
    )
    t = statistics.median(res)
    benchmark.extra_info.update(step_seconds=t, ep=ep)
    print(
        f"\nMoE 8 experts, 1024 tokens/rank, EP={ep}, {benchmark.group}: {t * 1e3:.1f} ms per step"
    )
