"""Per-test overhead of the multi-rank harness: the pool of live ranks (what the test suite
uses), fork (``run_ranks``' default elsewhere) and spawn.

What a multi-rank test pays before its own work: start N ranks, rendezvous, create the gloo
default group, return, tear down (forked or spawned); with the pool, send the call to live
ranks and collect the results. The mesh cases also build a full ParallelMesh (the pool's ranks
reuse its groups).
Run:  pytest bench/test_bench_harness.py --benchmark-json=bench/results/harness.json
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fastpar.launch import pool
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


@pytest.fixture
def pooled():
    """run_ranks on the pool of live ranks (started before the timing: its first call)."""
    pool.use_pool(True)
    yield
    pool.use_pool(False)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_pool_noop(benchmark, pooled, world):
    benchmark.group = f"harness-{world}-ranks"
    run_ranks(_noop, world)
    out = benchmark.pedantic(run_ranks, args=(_noop, world), rounds=20, iterations=1)
    assert out == list(range(world))


@pytest.mark.parametrize("world", [4, 8])
def test_pool_full_mesh(benchmark, pooled, world):
    benchmark.group = f"harness-{world}-ranks"
    run_ranks(group_sums, world, 2, 2, world // 4)
    out = benchmark.pedantic(
        run_ranks, args=(group_sums, world, 2, 2, world // 4), rounds=10, iterations=1
    )
    assert len(out) == world
