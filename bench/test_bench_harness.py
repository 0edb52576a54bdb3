"""Per-test overhead of the multi-rank harness: fork (the default) against spawn.

What a multi-rank test pays before its own work: start N ranks, rendezvous, create the gloo
default group, return, tear down. With ``--mesh`` the ranks also build a full ParallelMesh.
Run:  pytest bench/test_bench_harness.py --benchmark-json=bench/results/harness.json
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fastpar.mesh.check import group_sums
from fastpar.testing import run_ranks


def _noop():
    return dist.get_rank()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fork_noop(benchmark, world):
    benchmark.group = f"harness-{world}-ranks"
    out = benchmark.pedantic(run_ranks, args=(_noop, world), rounds=10, iterations=1)
    assert out == list(range(world))


@pytest.mark.parametrize("world", [4, 8])
def test_fork_full_mesh(benchmark, world):
    benchmark.group = f"harness-{world}-ranks"
    out = benchmark.pedantic(
        run_ranks, args=(group_sums, world, 2, 2, world // 4), rounds=5, iterations=1
    )
    assert len(out) == world


@pytest.mark.parametrize("world", [2, 4])
def test_fork_tp1_mesh(benchmark, world):
    benchmark.group = f"harness-{world}-ranks"
    out = benchmark.pedantic(run_ranks, args=(group_sums, world), rounds=10, iterations=1)
    assert len(out) == world


@pytest.mark.parametrize("world", [2, 4])
def test_spawn_tp1_mesh(benchmark, world):
    """The same work as test_fork_tp1_mesh with start_method='spawn' (torch re-imported)."""
    benchmark.group = f"harness-{world}-ranks"
    out = benchmark.pedantic(
        run_ranks,
        args=(group_sums, world),
        kwargs={"start_method": "spawn", "timeout": 120},
        rounds=2,
        iterations=1,
    )
    assert len(out) == world
