"""Parameter server against ring all-reduce, written on point-to-point sends (teaching code, not
fastpar's production path), beside the built-in all-reduce.

Each rank counts the bytes it sends and receives. The parameter server funnels everything
through rank 0 (it receives (N-1)·B and sends (N-1)·B: an N-fold hot spot); the ring sends and
receives 2(N-1)/N·B on every rank (reduce-scatter, then all-gather, over N-1 steps each).
Run:  pytest bench/test_bench_allreduce_teaching.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.testing import run_ranks


def parameter_server_all_reduce(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Sum ``x`` over all ranks through rank 0. Returns (sum, bytes sent, bytes received)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = x.numel() * x.element_size()
    if rank == 0:
        total = x.clone()
        buf = torch.empty_like(x)
        for src in range(1, world):
            dist.recv(buf, src=src)
            total += buf
        for dst in range(1, world):
            dist.send(total, dst=dst)
        return total, (world - 1) * nbytes, (world - 1) * nbytes
    dist.send(x, dst=0)
    out = torch.empty_like(x)
    dist.recv(out, src=0)
    return out, nbytes, nbytes


def ring_all_reduce(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Sum ``x`` over all ranks with a ring: N-1 reduce-scatter steps, N-1 all-gather steps.
    Returns (sum, bytes sent, bytes received)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return x.clone(), 0, 0
    chunks = list(x.clone().chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = received = 0

    def exchange(send_idx: int, recv_idx: int, accumulate: bool) -> None:
        nonlocal sent, received
        incoming = torch.empty_like(chunks[recv_idx])
        ops = [
            dist.P2POp(dist.isend, chunks[send_idx].contiguous(), right),
            dist.P2POp(dist.irecv, incoming, left),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        sent += chunks[send_idx].numel() * x.element_size()
        received += incoming.numel() * x.element_size()
        chunks[recv_idx] = chunks[recv_idx] + incoming if accumulate else incoming

    for step in range(world - 1):  # reduce-scatter: chunk (rank - step) travels right, summed
        exchange((rank - step) % world, (rank - step - 1) % world, accumulate=True)
    for step in range(world - 1):  # all-gather: the completed chunk (rank + 1 - step) travels right
        exchange((rank + 1 - step) % world, (rank - step) % world, accumulate=False)
    return torch.cat(chunks), sent, received


def _compare(numel: int, iters: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    want = torch.arange(numel, dtype=torch.float32) * (world * (world + 1) / 2)
    out = {}
    for name, fn in (("server", parameter_server_all_reduce), ("ring", ring_all_reduce)):
        got, sent, recv = fn(x)
        torch.testing.assert_close(got, want)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        out[name] = {"sent": sent, "received": recv, "seconds": statistics.median(times)}
    times = []
    for _ in range(iters):
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        times.append(time.perf_counter() - t0)
    out["builtin"] = {"seconds": statistics.median(times)}
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_server_vs_ring(benchmark, world):
    numel = 1 << 20  # 4 MiB of fp32, divisible by every world size here
    benchmark.group = f"allreduce-teaching-{world}"
    res = benchmark.pedantic(run_ranks, args=(_compare, world, numel, 5), rounds=1, iterations=1)
    b = numel * 4
    ring_expected = 2 * (world - 1) / world * b
    for rank, r in enumerate(res):
        assert r["ring"]["sent"] == ring_expected and r["ring"]["received"] == ring_expected
        hot = (world - 1) * b if rank == 0 else b
        assert r["server"]["sent"] == hot and r["server"]["received"] == hot
    med = {
        k: statistics.median(r[k]["seconds"] for r in res) for k in ("server", "ring", "builtin")
    }
    benchmark.extra_info.update(
        bytes_per_rank_ring=ring_expected,
        bytes_rank0_server=(world - 1) * b,
        seconds=med,
        server_over_ring=med["server"] / med["ring"],
        ring_over_builtin=med["ring"] / med["builtin"],
    )
    print(
        f"\nN={world}: bytes sent by the busiest rank — server {(world - 1) * b / 2**20:.1f} MiB, "
        f"ring {ring_expected / 2**20:.2f} MiB (2(N-1)/N·B); time server {med['server'] * 1e3:.1f} ms, "
        f"ring {med['ring'] * 1e3:.1f} ms, built-in {med['builtin'] * 1e3:.1f} ms"
    )
