"""Fused linear cross-entropy against linear + CE: provider × size × {forward, full}, one rank.

Providers: ``fused`` (``vocab_parallel_linear_cross_entropy``: Triton statistics / gradient on
a GPU, the torch reference on a CPU; torch matmuls), ``unfused`` (``F.linear`` +
``vocab_parallel_cross_entropy``), ``torch`` (``F.linear`` + ``F.cross_entropy``) and, on a GPU
when ``liger_kernel`` imports, ``liger`` (``LigerFusedLinearCrossEntropyLoss``).

Sizes: on a CPU fp32 V=32k × N=4k tokens × H=256 (the issue's measure; H small to keep it
quick); on a GPU bf16 V=32k / 128k × N=4k / 8k × H=4096. ``full`` is forward + backward to
d hidden and d weight (``torch.autograd.grad``), ``forward`` runs under ``no_grad``.

Peak memory of one call above what was allocated before it, the gradients it returns
included: on a GPU ``torch.cuda.max_memory_allocated``; on a CPU the running sum of every
allocation and free the profiler records (``profile_memory=True``: c10's CPU allocator, each
temporary inside an op included). ``test_side_by_side`` runs the providers alternately in one
round and records ``peak_bytes`` and ``seconds`` per provider and the ratios
``fused_over_torch`` / ``fused_over_unfused`` of both, against the goal of at most 1/8 of the
unfused peak (``meets_memory_goal``); on a CPU the step times also with one thread
(``seconds_1_thread``: the fused loop's many smaller ops lose most when other processes
keep the cores busy).

Run:  pytest bench/test_bench_linear_cross_entropy.py \
          --benchmark-json=bench/results/cpu-linear-ce-$(date +%F).json
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from _common import cpu_peak_and_held, record_bandwidth

from fastpar.nn.functional import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
if CUDA:
    SIZES = [(v, n, 4096) for v in (32768, 131072) for n in (4096, 8192)]
    ROUNDS, WARMUP = 10, 2
else:
    SIZES = [(32768, 4096, 256)]
    ROUNDS, WARMUP = 5, 1
GOAL = 1 / 8  # fused peak / unfused peak at V=32k, N=4k: the fusion's goal


def _liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # not installed, or broken
        pytest.skip(f"liger_kernel does not import: {type(exc).__name__}: {exc}")
    fn = LigerFusedLinearCrossEntropyLoss()
    return lambda h, w, t: fn(w, h, t)


def _loss_fn(provider: str):
    if provider == "fused":
        return vocab_parallel_linear_cross_entropy
    if provider == "unfused":
        return lambda h, w, t: vocab_parallel_cross_entropy(F.linear(h, w), t)
    if provider == "torch":
        return lambda h, w, t: F.cross_entropy(F.linear(h, w), t)
    if provider == "liger":
        if not CUDA:
            pytest.skip("Liger-Kernel runs Triton on CUDA tensors only")
        return _liger()
    raise ValueError(provider)


def _inputs(vocab: int, tokens: int, hidden: int):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    h = torch.randn(tokens, hidden, device=DEVICE, generator=gen).to(DTYPE).requires_grad_()
    w = (torch.randn(vocab, hidden, device=DEVICE, generator=gen) * hidden**-0.5).to(DTYPE)
    t = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    t[: tokens // 64] = -100
    return h, w.requires_grad_(), t


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak_bytes(run) -> int:
    """Extra memory ``run()`` holds at its peak (its outputs included)."""
    if not CUDA:
        return cpu_peak_and_held(run)[0]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


def _step(loss_fn, h, w, t):
    def run():
        out = torch.autograd.grad(loss_fn(h, w, t), (h, w))
        _sync()
        return out

    return run


@pytest.mark.parametrize("mode", ["forward", "full"])
@pytest.mark.parametrize(
    ("vocab", "tokens", "hidden"), SIZES, ids=[f"V{v}-N{n}-H{h}" for v, n, h in SIZES]
)
@pytest.mark.parametrize("provider", ["fused", "unfused", "torch", "liger"])
def test_linear_cross_entropy(benchmark, provider, vocab, tokens, hidden, mode):
    loss_fn = _loss_fn(provider)
    h, w, t = _inputs(vocab, tokens, hidden)
    if mode == "forward":

        def run():
            with torch.no_grad():
                out = loss_fn(h, w, t)
            _sync()
            return out

    else:
        run = _step(loss_fn, h, w, t)
    run()  # warm-up: compiles / autotunes
    benchmark.group = f"linear_cross_entropy-{mode}-V{vocab}-N{tokens}-H{hidden}"
    elem = h.element_size()
    moved = elem * (tokens * hidden + vocab * hidden) * (1 if mode == "forward" else 3)
    benchmark.extra_info.update(
        provider=provider,
        mode=mode,
        vocab=vocab,
        tokens=tokens,
        hidden=hidden,
        dtype=str(DTYPE),
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
        compulsory_bytes=moved,
        peak_memory_bytes=peak_bytes(run),
    )
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    record_bandwidth(benchmark, moved)


@pytest.mark.parametrize(
    ("vocab", "tokens", "hidden"), SIZES, ids=[f"V{v}-N{n}-H{h}" for v, n, h in SIZES]
)
def test_side_by_side(benchmark, vocab, tokens, hidden):
    """Every provider in one round: peak memory each, then alternating timed steps."""
    h, w, t = _inputs(vocab, tokens, hidden)
    providers = ["fused", "unfused", "torch"]
    runs = {p: _step(_loss_fn(p), h, w, t) for p in providers}
    grads = (tokens + vocab) * hidden * h.element_size()  # d hidden + d weight: the outputs
    peaks = {p: peak_bytes(run) for p, run in runs.items()}
    times: dict[str, list[float]] = {p: [] for p in providers}

    def round_():
        for p in providers:
            start = time.perf_counter()
            runs[p]()
            times[p].append(time.perf_counter() - start)

    round_()  # warm-up
    for ts in times.values():
        ts.clear()
    benchmark.pedantic(round_, rounds=ROUNDS, warmup_rounds=0, iterations=1)
    seconds = {p: statistics.median(ts) for p, ts in times.items()}
    one_thread = {}
    if not CUDA:  # a shared CPU: many small ops suffer most from busy cores; one thread less so
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for ts in times.values():
                ts.clear()
            for _ in range(ROUNDS):
                round_()
        finally:
            torch.set_num_threads(threads)
        one_thread = {p: statistics.median(ts) for p, ts in times.items()}
        benchmark.extra_info.update(
            seconds_1_thread=one_thread,
            fused_over_unfused_seconds_1_thread=one_thread["fused"] / one_thread["unfused"],
            fused_over_torch_seconds_1_thread=one_thread["fused"] / one_thread["torch"],
        )
    benchmark.group = f"linear_cross_entropy-side_by_side-V{vocab}-N{tokens}-H{hidden}"
    benchmark.extra_info.update(
        vocab=vocab,
        tokens=tokens,
        hidden=hidden,
        dtype=str(DTYPE),
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
        peak_bytes=peaks,
        peak_bytes_without_grads={p: b - grads for p, b in peaks.items()},
        seconds=seconds,
        fused_over_unfused_peak=peaks["fused"] / peaks["unfused"],
        fused_over_torch_peak=peaks["fused"] / peaks["torch"],
        fused_over_unfused_seconds=seconds["fused"] / seconds["unfused"],
        fused_over_torch_seconds=seconds["fused"] / seconds["torch"],
        memory_goal=GOAL,
        meets_memory_goal=peaks["fused"] <= GOAL * min(peaks["unfused"], peaks["torch"]),
    )
