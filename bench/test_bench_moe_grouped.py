"""The dropless experts of one rank (``fastpar.moe.experts.segments``), forward + backward, by
path (``set_segments_impl``): ``loop`` (one expert at a time, weights split by ``unbind``),
``grouped`` (two ``grouped_linear`` calls: ``torch._grouped_mm`` where it applies) and
``padded`` (rows zero-padded to the largest count, one ``torch.bmm`` per matrix); and
``before``, the CPU eager path at commit 91df471 (the same loop with the weights
indexed ``w1[e]``, whose backward builds E zero-filled [E, ...] gradients), written here.

Sizes (experts E, hidden H, ffn F, tokens T, top-2 so N = 2T rows), counts ``balanced``
(equal shares, ±10 % jitter) or ``skewed`` (share of expert e ∝ 1 / (e + 1): the first holds
48 % of the rows at E = 4, 37 % at E = 8, 30 % at E = 16), kinds ``mlp`` (GELU, biases: the default) and
``swiglu`` (gated, no biases). CPU fp32, small sizes; CUDA bf16, larger ones.

The four run alternately in every round (the first one rotates), after one warm-up round;
``extra_info`` holds the median seconds of each (forward, and forward + backward), the median
over rounds of each round's forward + backward ratios ``<path>_over_loop`` and
``<path>_over_before`` (paired in time, so a neighbour's load on a shared CPU cancels more than
in separate medians), the forward-only ``forward_<path>_over_loop``, and
``padded_rows_over_rows`` (E · max count / N: the padded path's extra work and memory).

Run:  pytest bench/test_bench_moe_grouped.py -s --benchmark-json=bench/results/<name>.json
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from fastpar.moe import experts

CUDA = torch.cuda.is_available()
IMPLS = ("loop", "grouped", "padded")
PROVIDERS = ("before", *IMPLS)
SIZES = {  # (experts, hidden, ffn, tokens), top-2
    "cpu": [
        (8, 256, 512, 1024),
        (4, 512, 1024, 1024),
        (8, 512, 1024, 2048),
        (4, 256, 512, 4096),
        (16, 256, 512, 2048),
    ],
    "cuda": [(8, 2048, 4096, 8192), (16, 1024, 2048, 16384), (4, 4096, 8192, 4096)],
}
ROUNDS = {"cpu": 9, "cuda": 20}
DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
KINDS = {"mlp": (False, "gelu", True), "swiglu": (True, "silu", False)}
NO_GPU = pytest.mark.skipif(not CUDA, reason="no CUDA GPU here: the GPU tier runs it")
CASES = [
    pytest.param(
        d,
        s,
        id=f"{d}-E{s[0]}-H{s[1]}-F{s[2]}-T{s[3]}",
        marks=[pytest.mark.cuda, NO_GPU] if d == "cuda" else [],
    )
    for d in ("cpu", "cuda")
    for s in SIZES[d]
]


def _counts(e: int, n: int, skewed: bool) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    if skewed:
        share = torch.tensor([1 / (i + 1) for i in range(e)])
    else:
        share = 1 + 0.2 * (torch.rand(e, generator=gen) - 0.5)
    counts = (share / share.sum() * n).floor().long()
    counts[0] += n - counts.sum()
    return counts.tolist()


def _data(device, e, h, f, n, kind):
    gated, _, bias = KINDS[kind]
    width = 2 * f if gated else f
    dtype = DTYPE[device]
    gen = torch.Generator().manual_seed(0)

    def param(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen) * scale
        return t.to(device=device, dtype=dtype).requires_grad_()

    x = param(n, h)
    w = (
        param(e, h, width, scale=h**-0.5),
        param(e, width) if bias else None,
        param(e, f, h, scale=f**-0.5),
        param(e, h) if bias else None,
    )
    grad = torch.randn(n, h, generator=gen).to(device=device, dtype=dtype)
    return x, w, grad


def _clock(device):
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _before(x, counts, w1, b1, w2, b2, gated, activation):
    """``segments`` eagerly on a CPU before the grouped GEMM (commit 91df471)."""
    outs = []
    for e, part in enumerate(x.split(counts.tolist())):
        h = part @ w1[e] if b1 is None else part @ w1[e] + b1[e]
        h = experts.hidden(h, gated, activation)
        outs.append(h @ w2[e] if b2 is None else h @ w2[e] + b2[e])
    return torch.cat(outs)


def _call(provider, x, counts, w, gated, act):
    if provider == "before":
        return _before(x, counts, *w, gated, act)
    experts.set_segments_impl(provider)
    return experts.segments(x, counts, *w, gated, act)


def _measure(device, size, skewed, kind):
    e, h, f, tokens = size
    n = 2 * tokens
    counts_list = _counts(e, n, skewed)
    counts = torch.tensor(counts_list, device=device)
    x, w, grad = _data(device, e, h, f, n, kind)
    gated, act, _ = KINDS[kind]
    params = [p for p in (x, *w) if p is not None]
    fwd = {i: [] for i in PROVIDERS}
    full = {i: [] for i in PROVIDERS}
    old = experts.get_segments_impl()
    try:
        for r in range(ROUNDS[device] + 1):
            for j in range(len(PROVIDERS)):
                provider = PROVIDERS[(r + j) % len(PROVIDERS)]
                t0 = _clock(device)
                y = _call(provider, x, counts, w, gated, act)
                t1 = _clock(device)
                y.backward(grad)
                t2 = _clock(device)
                for p in params:
                    p.grad = None
                if r:
                    fwd[provider].append(t1 - t0)
                    full[provider].append(t2 - t0)
    finally:
        experts.set_segments_impl(old)

    def ratio(times, a, b):
        return statistics.median(p / q for p, q in zip(times[a], times[b], strict=True))

    res = {
        "seconds": {i: statistics.median(full[i]) for i in PROVIDERS},
        "forward_seconds": {i: statistics.median(fwd[i]) for i in PROVIDERS},
    }
    for i in ("grouped", "padded"):
        res[f"{i}_over_loop"] = ratio(full, i, "loop")
    for i in IMPLS:
        res[f"{i}_over_before"] = ratio(full, i, "before")
    for i in ("grouped", "padded"):
        res[f"forward_{i}_over_loop"] = ratio(fwd, i, "loop")
    res.update(padded_rows_over_rows=e * max(counts_list) / n, counts=counts_list)
    return res


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("device,size", CASES)
def test_moe_grouped_experts(benchmark, device, size, skewed, kind):
    counts = "skewed" if skewed else "balanced"
    benchmark.group = f"moe-grouped-{device}-{kind}-{counts}"
    res = benchmark.pedantic(_measure, args=(device, size, skewed, kind), rounds=1, iterations=1)
    benchmark.extra_info.update(res, device=device, size=list(size), kind=kind, counts_kind=counts)
    e, h, f, t = size
    print(
        f"\n{device} E{e} H{h} F{f} T{t} top-2 {kind} {counts}: before "
        f"{res['seconds']['before'] * 1e3:.1f} ms fwd+bwd; over before: loop "
        f"{res['loop_over_before']:.2f} grouped {res['grouped_over_before']:.2f} padded "
        f"{res['padded_over_before']:.2f}; over loop: grouped {res['grouped_over_loop']:.2f} "
        f"(fwd {res['forward_grouped_over_loop']:.2f}) padded {res['padded_over_loop']:.2f} "
        f"(fwd {res['forward_padded_over_loop']:.2f}, {res['padded_rows_over_rows']:.2f}x rows)"
    )
