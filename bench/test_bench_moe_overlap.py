"""How much all-to-all time the overlapped MoE layer hides, measured in the same run.

For K chunks (capacity mode, EP = 2 over gloo), each rank times, interleaved:
  t_comm        the chunked all-to-alls alone (the experts replaced by the identity),
  t_compute     the experts alone on the same rows (no communication),
  t_overlapped  the overlapped layer (communication and compute together),
and reports hidden = (t_comm + t_compute - t_overlapped) / t_comm: 1 when the all-to-alls are
entirely hidden behind compute, 0 when nothing overlaps. The expert MLP is sized so compute is
at least as long as communication.

Each time is the slowest rank's median over the iterations (the EP group is as slow as its
slowest rank). Two more figures explain the result on a CPU, where gloo moves the bytes with
the host's cores:
- cores_busy_fraction: the CPU time all ranks spend during t_comm (every thread, the gloo
  workers and TCP loops too) as a share of cores x t_comm. When every core is already computing
  (ranks x compute threads >= cores, as with EP = 2 on a 2-core machine), that share of the
  all-to-all time cannot hide: it is work the same cores must still do, so 1 - cores_busy
  bounds ``hidden`` there.
- hidden_host_free_fraction: the same schedule with the experts replaced by a wait of the same
  length that leaves the cores free (time.sleep, timed alone in the same run), the situation
  of experts running on a GPU, where the host only launches them. It shows what the schedule
  hides when the compute does not compete with the transport for the cores.
On a GPU (one device, a one-rank NCCL group; the all-to-all is then a device copy) the same
three timings are taken with the experts on the GPU.
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
ITERS = 15


def _measure(k: int, transport: str, device: str = "cpu", iters: int = ITERS) -> dict:
    os.environ["FASTPAR_MOE_TRANSPORT"] = transport
    ep = dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = ParallelMesh(ep=ep)
    torch.manual_seed(0)
    e, c, h = 4, 512, 512
    moe = MoE(h, 384, e, top_k=1, capacity_factor=1.0, mesh=mesh, overlap_chunks=k).to(device)
    permuted = torch.randn(e, c, h, device=device)
    chunks = CapacityChunks(e, c, h, ep, k)
    params = moe._expert_params()
    share = [(c1 - c0) / c for c0, c1 in chunks.bounds]
    sleep_s = [0.0] * len(share)  # per-chunk stand-in for compute, set after the warm-up

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def comm_only():
        OverlappedExperts.apply(permuted, chunks, lambda x, j: x, moe.ep_group, *params)

    def compute_only():
        for j in range(len(chunks.bounds)):
            moe._experts_batched(chunks.to_compute(chunks.take(permuted, j), j))

    def overlapped():
        OverlappedExperts.apply(
            permuted, chunks, lambda x, j: moe._experts_batched(x), moe.ep_group, *params
        )

    def wait_only():
        for s in sleep_s:
            time.sleep(s)

    def host_free():
        def stand_in(x, j):
            time.sleep(sleep_s[j])
            return x

        OverlappedExperts.apply(permuted, chunks, stand_in, moe.ep_group, *params)

    runs = [("comm", comm_only), ("compute", compute_only), ("overlapped", overlapped)]
    if device == "cpu":
        runs += [("wait", wait_only), ("host_free", host_free)]
    times = {name: [] for name, _ in runs}
    cpu = []
    with torch.no_grad():
        compute_only()  # warm
        warm = []
        for _ in range(3):
            t0 = time.perf_counter()
            compute_only()
            warm.append(time.perf_counter() - t0)
        # the same stand-in on every rank (the slowest rank's compute), or the ranks drift apart
        longest = torch.tensor([statistics.median(warm)], dtype=torch.float64, device=device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        sleep_s[:] = [longest.item() * s for s in share]
        for it in range(iters + 1):
            for name, fn in runs:
                dist.barrier()
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                sync()
                t1, c1 = time.perf_counter(), time.process_time()
                dist.barrier()
                if it:
                    times[name].append(t1 - t0)
                    if name == "comm":
                        cpu.append(c1 - c0)
    out = {name: statistics.median(v) for name, v in times.items()}
    out["comm_cpu"] = statistics.median(cpu)
    return out


def _hidden(t: dict, compute: str, overlapped: str) -> float:
    return (t["comm"] + t[compute] - t[overlapped]) / t["comm"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_hidden_fraction(benchmark, k, transport):
    from fastpar.testing import run_ranks

    ranks, cores = 2, len(os.sched_getaffinity(0))
    benchmark.group = f"moe-overlap-{transport}"
    res = benchmark.pedantic(
        run_ranks, args=(_measure, ranks, k, transport), rounds=1, iterations=1
    )
    # the EP group is as slow as its slowest rank
    t = {name: max(r[name] for r in res) for name in res[0]}
    cores_busy = sum(r["comm_cpu"] for r in res) / (cores * t["comm"])
    info = {
        "hidden_fraction": _hidden(t, "compute", "overlapped"),
        "hidden_host_free_fraction": _hidden(t, "wait", "host_free"),
        "cores_busy_fraction": cores_busy,
        "compute_covers_comm": t["compute"] >= t["comm"],
    }
    benchmark.extra_info.update(seconds=t, k=k, transport=transport, ranks=ranks, cores=cores)
    benchmark.extra_info.update(info)
    ms = {name: f"{v * 1e3:.1f}" for name, v in t.items()}
    print(
        f"\nK={k} {transport}: comm {ms['comm']} ms (cores busy {cores_busy:.0%}), compute "
        f"{ms['compute']} ms, overlapped {ms['overlapped']} ms -> hidden "
        f"{info['hidden_fraction']:.0%} of the all-to-all time (bound with every core computing: "
        f"{max(0.0, 1 - cores_busy):.0%}); host-free experts: wait {ms['wait']} ms, "
        f"overlapped {ms['host_free']} ms -> hidden {info['hidden_host_free_fraction']:.0%}"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (NCCL)")
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_hidden_fraction_one_gpu(benchmark, k):
    from fastpar.testing import run_ranks

    benchmark.group = "moe-overlap-cuda"
    res = benchmark.pedantic(
        run_ranks,
        args=(_measure, 1, k, overlap.transport(), "cuda"),
        kwargs={"backend": "nccl", "start_method": "spawn"},
        rounds=1,
        iterations=1,
    )
    t = {name: v for name, v in res[0].items() if name != "comm_cpu"}
    hidden = _hidden(t, "compute", "overlapped")
    benchmark.extra_info.update(seconds=t, k=k, hidden_fraction=hidden)
    print(
        f"\nK={k} cuda: comm {t['comm'] * 1e3:.2f} ms, compute {t['compute'] * 1e3:.2f} ms, "
        f"overlapped {t['overlapped'] * 1e3:.2f} ms -> hidden {hidden:.0%}"
    )
