"""Context parallelism (``fastpar.parallel.context``) on CPU ranks over gloo, what the issue
asks to measure:

* attention memory per rank against cp, on one sequence of S tokens split over cp ranks, from
  the profiler's allocation events: the activation memory (what the forward leaves allocated
  for backward: its output, the log-sum-exp; q, k, v are the caller's), the forward's peak
  (plus the K/V block in flight) and the forward + backward peak (plus gradients and the dK/dV
  blocks in flight); goal: activation memory within 10 % of 1/cp of the cp = 1 figure;
* the fraction of K/V transfer time hidden behind the block compute, two ways: 1 − (time ring
  attention waited on transfers) / (the same transfers timed alone, no compute), and 1 −
  (step time − the same step with the transfers replaced by local copies) / (transfers
  alone); both count the ranks' skew as exposed (a rank waits for a slower peer's send);
* step time of the all-to-all (Ulysses) variant beside ring attention (same ranks, alternated);
* step time beside torch's context-parallel attention (``context_parallel``), where it runs.

Run:  pytest bench/test_bench_context.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
from _common import cpu_peak_and_held

from fastpar.parallel.context import (
    all_to_all_attention,
    measure_waits,
    ring_attention,
)
from fastpar.parallel.context import ring as context
from fastpar.testing import run_ranks

B, H, D, S = 1, 4, 32, 1024


def _qkv(n: int):
    g = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3)]


def _memory_and_overlap(iters: int = 4) -> dict:
    cp = dist.get_world_size()
    q, k, v = _qkv(S // cp)

    def step(attention=ring_attention):
        out = attention(q, k, v)
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None

    step()  # warm-up (connections, allocator)
    peak, _ = cpu_peak_and_held(step)
    forward_peak, held = cpu_peak_and_held(lambda: ring_attention(q, k, v))
    dist.barrier()
    times, waits, a2a = [], [], []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        with measure_waits() as w:
            step()
        times.append(time.perf_counter() - t0)
        waits.append(w["wait_s"])
        dist.barrier()
        t0 = time.perf_counter()
        step(all_to_all_attention)
        a2a.append(time.perf_counter() - t0)
    local = []  # the same compute, each transfer replaced by a local copy (wrong numbers)
    real = context._exchange
    context._exchange = lambda send, group, tag=0: (send.clone(), [])
    try:
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            local.append(time.perf_counter() - t0)
    finally:
        context._exchange = real
    alone = []  # the same transfers, no compute: 2 cp - 2 K/V blocks and cp dK/dV blocks
    kv = torch.stack([k.detach(), v.detach()]).contiguous()
    dkv = torch.zeros(2, *k.shape)
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        if cp > 1:
            for buf, n in ((kv, 2 * (cp - 1)), (dkv, cp)):
                recv = torch.empty_like(buf)
                for _ in range(n):  # inline, no background thread: the plain transfer time
                    context._transfer(buf, recv, None, 0)
        alone.append(time.perf_counter() - t0)
    return {
        "peak_bytes": peak,
        "forward_peak_bytes": forward_peak,
        "activation_bytes": held,
        "step_s": statistics.median(times),
        "wait_s": statistics.median(waits),
        "a2a_step_s": statistics.median(a2a),
        "compute_only_s": statistics.median(local),
        "transfer_alone_s": statistics.median(alone),
    }


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_memory_and_hidden_transfer(benchmark, cp):
    benchmark.group = "context-parallel-attention"
    res = benchmark.pedantic(
        run_ranks,
        args=(_memory_and_overlap, cp),
        kwargs=dict(threads_per_rank=1),
        rounds=1,
        iterations=1,
    )
    peak = max(r["peak_bytes"] for r in res)
    fwd = max(r["forward_peak_bytes"] for r in res)
    held = max(r["activation_bytes"] for r in res)
    step = statistics.median(r["step_s"] for r in res)
    wait = statistics.median(r["wait_s"] for r in res)
    alone = statistics.median(r["transfer_alone_s"] for r in res)
    compute = statistics.median(r["compute_only_s"] for r in res)
    a2a = statistics.median(r["a2a_step_s"] for r in res)
    hidden = None if cp == 1 or alone == 0 else max(0.0, 1.0 - wait / alone)
    exposed = max(0.0, step - compute)
    hidden_step = None if cp == 1 or alone == 0 else max(0.0, 1.0 - exposed / alone)
    info = dict(
        cp=cp,
        seq_len=S,
        peak_bytes_per_rank=peak,
        forward_peak_bytes=fwd,
        activation_bytes=held,
        step_seconds=step,
        wait_seconds=wait,
        transfer_alone_seconds=alone,
        hidden_fraction=hidden,
        compute_only_seconds=compute,
        hidden_fraction_by_step=hidden_step,
        all_to_all_step_seconds=a2a,
        all_to_all_over_ring=a2a / step,
    )
    fn = test_ring_attention_memory_and_hidden_transfer
    base = getattr(fn, "base", None)
    if cp == 1:
        fn.base = (held, fwd, peak)
    elif base:
        ratio = held / base[0]
        info.update(
            activation_over_cp1=ratio,
            forward_peak_over_cp1=fwd / base[1],
            peak_over_cp1=peak / base[2],
            goal=1.1 / cp,
            meets_memory_goal=ratio <= 1.1 / cp,
        )
    benchmark.extra_info.update(info)
    ratios = (
        (
            f" ({held / base[0]:.3f} / {fwd / base[1]:.3f} / {peak / base[2]:.3f} of cp=1; "
            f"goal for the first <= {1.1 / cp:.3f})"
        )
        if cp > 1 and base
        else ""
    )
    print(
        f"\nring attention S={S}, cp={cp}: activations {held / 2**20:.2f} MiB/rank, forward "
        f"peak {fwd / 2**20:.2f}, fwd+bwd peak {peak / 2**20:.2f}"
        + ratios
        + f", step {step * 1e3:.1f} ms, waited {wait * 1e3:.1f} ms of {alone * 1e3:.1f} ms"
        + (f" transfers ({hidden:.0%} hidden)" if hidden is not None else "")
        + f"; compute alone {compute * 1e3:.1f} ms"
        + (f" ({hidden_step:.0%} hidden by step time)" if hidden_step is not None else "")
        + f"; all-to-all variant {a2a * 1e3:.1f} ms ({a2a / step:.2f}x ring)"
    )


def _torch_cp() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
        torch.nn.functional.scaled_dot_product_attention(
            ql, kl, vl, is_causal=True
        ).sum().backward()


def test_torch_context_parallel_peer():
    """torch's ``context_parallel`` has no CPU path: it dispatches SDPA to
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding
    strategy (torch 2.13), so no ratio can be measured on gloo. Skips with the error when that
    is still so; measures nothing else."""
    try:
        run_ranks(_torch_cp, 2)
    except Exception as exc:  # RankError wrapping NotImplementedError
        # the reason short enough for one -ra line of 100 columns; the error in the log
        print(f"torch context_parallel on CPU / gloo: {exc}"[:2000])
        pytest.skip(f"torch context_parallel has no CPU path ({type(exc).__name__})")
    pytest.fail("torch's context_parallel now runs on CPU: add the side-by-side step time")
