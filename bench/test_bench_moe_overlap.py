"""How much all-to-all time the overlapped MoE layer hides, measured in the same run.

For K chunks (capacity mode, EP = 2 over gloo), each rank times, interleaved:
  t_comm        the chunked all-to-alls alone (the experts replaced by the identity),
  t_compute     the experts alone on the same rows (no communication),
  t_overlapped  the overlapped layer (communication and compute together),
and reports hidden = (t_comm + t_compute - t_overlapped) / t_comm — 1 when the all-to-alls are
entirely hidden behind compute, 0 when nothing overlaps. The expert MLP is sized so compute is at
least as long as communication. On a 2-core machine the gloo worker threads compete with the
compute thread for the cores, which caps what can be hidden.
Run:  pytest bench/test_bench_moe_overlap.py -s --benchmark-json=...
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from fastpar import ParallelMesh
from fastpar.moe import MoE, overlap
from fastpar.moe.overlap import CapacityChunks, OverlappedExperts

TRANSPORTS = ["python"] + (["extension"] if overlap._extension_ops() else [])


def _measure(k: int, transport: str, iters: int = 7) -> dict:
    os.environ["FASTPAR_MOE_TRANSPORT"] = transport
    ep = dist.get_world_size()
    mesh = ParallelMesh(ep=ep)
    torch.manual_seed(0)
    moe = MoE(512, 384, 4, top_k=1, capacity_factor=1.0, mesh=mesh, overlap_chunks=k)
    e, c, h = 4, 512, 512
    permuted = torch.randn(e, c, h)
    chunks = CapacityChunks(e, c, h, ep, k)
    params = moe._expert_params()

    def comm_only():
        OverlappedExperts.apply(permuted, chunks, lambda x, j: x * 1.0, moe.ep_group, *params)

    def compute_only():
        for j in range(len(chunks.bounds)):
            moe._experts_batched(chunks.to_compute(chunks.take(permuted, j), j))

    def overlapped():
        OverlappedExperts.apply(
            permuted, chunks, lambda x, j: moe._experts_batched(x), moe.ep_group, *params
        )

    times = {"comm": [], "compute": [], "overlapped": []}
    with torch.no_grad():
        for it in range(iters + 1):
            for name, fn in (
                ("comm", comm_only),
                ("compute", compute_only),
                ("overlapped", overlapped),
            ):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                if it:
                    times[name].append(time.perf_counter() - t0)
    return {k_: statistics.median(v) for k_, v in times.items()}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_hidden_fraction(benchmark, k, transport):
    from fastpar.testing import run_ranks

    benchmark.group = f"moe-overlap-{transport}"
    res = benchmark.pedantic(run_ranks, args=(_measure, 2, k, transport), rounds=1, iterations=1)
    t = {
        name: statistics.median(r[name] for r in res) for name in ("comm", "compute", "overlapped")
    }
    hidden = (t["comm"] + t["compute"] - t["overlapped"]) / t["comm"]
    benchmark.extra_info.update(seconds=t, hidden_fraction=hidden, k=k, transport=transport)
    print(
        f"\nK={k} {transport}: comm {t['comm'] * 1e3:.1f} ms, compute {t['compute'] * 1e3:.1f} ms, "
        f"overlapped {t['overlapped'] * 1e3:.1f} ms -> hidden {hidden:.0%} of the all-to-all time"
    )
