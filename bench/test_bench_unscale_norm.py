"""Unscale + inf/NaN check + grad norm over many gradients: provider × (tensors, elements, dtype).

Providers (all in place, ``inv_scale = 0.5`` as a 0-dim fp32 device tensor, and all ending
with a 0-dim found_inf flag and the total norm on the device, no host sync):

* ``torch_two_pass``: ``torch._amp_foreach_non_finite_check_and_unscale_`` then
  ``torch._foreach_norm`` + stack + norm (what GradScaler.unscale_ + clip_grad_norm_ do);
* ``fastpar``: ``unscale_and_norm`` (Triton on a GPU, the torch reference on a CPU) + sqrt;
  it also returns max |g|, which the other providers do not compute;
* ``loop``: a per-tensor Python loop of ``mul_`` + ``vector_norm``;
* ``fastpar_read_only``: ``norm_and_inf`` (the read-only pass of the folded step: nothing
  written, so its compulsory bytes are one read of each gradient).

Sizes: on a GPU 100 / 1,000 / 10,000 tensors × 10M / 100M / 1B elements, fp32 and bf16
(combinations that do not fit in free memory are skipped); on a CPU 100 / 1,000 tensors × 1M /
10M fp32 elements. Tensor sizes within a set are log-uniform (a few large, many small).

``extra_info``: compulsory bytes (each grad read once and written once), bytes/s, on a GPU the
fraction of peak HBM bandwidth (H200 4.8 TB/s, H100 3.35 TB/s), and ``time_vs_torch_two_pass``
(median time / the torch_two_pass median of the same group; < 1 is faster). On a CPU compare
these ratios, not absolute times. All providers of a size share one benchmark group.

Also: ``test_launch_host_time`` — the host time of one Triton launcher call over 200
tensors with the kernel replaced by a no-op, the pointer table cached or built and copied every
call; ``test_mixed_precision_step`` — ``MixedPrecisionOptimizer`` over ``FusedAdamW`` on a bf16
model, the unscaling step (unscale into fp32 main gradients, then AdamW reads them: 2 + 4 + 4 B
a gradient element) beside the folded one (read-only pass, AdamW unscales: 2 + 2 B).

Run:  pytest bench/test_bench_unscale_norm.py --benchmark-json=bench/results/unscale_norm.json
"""

from __future__ import annotations

import pytest
import torch
from _common import record_bandwidth

from fastpar.amp import DynamicLossScaler
from fastpar.ops.unscale_norm import norm_and_inf, unscale_and_norm
from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PROVIDERS = ("torch_two_pass", "fastpar", "loop", "fastpar_read_only")  # torch first: ratios
if CUDA:
    SIZES = [
        (t, e, d) for d in ("fp32", "bf16") for t in (100, 1000, 10000) for e in (1e7, 1e8, 1e9)
    ]
    ROUNDS, WARMUP = 10, 2
else:
    SIZES = [(t, e, "fp32") for t in (100, 1000) for e in (1e6, 1e7)]
    ROUNDS, WARMUP = 5, 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = [(p, *size) for size in SIZES for p in PROVIDERS]
_MEDIANS: dict[str, float] = {}  # group -> torch_two_pass median


def _sizes(n_tensors: int, total: int, seed: int = 0) -> list[int]:
    """``n_tensors`` log-uniform sizes summing to ``total`` (each at least 1)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(n_tensors, generator=gen, dtype=torch.float64) * 9.0)
    sizes = (weights / weights.sum() * (total - n_tensors)).floor().long() + 1
    sizes[0] += total - int(sizes.sum())
    return sizes.tolist()


def _make_grads(n_tensors: int, total: int, dtype: torch.dtype) -> list[torch.Tensor]:
    free = torch.cuda.mem_get_info()[0] if CUDA else None
    need = total * torch.tensor([], dtype=dtype).element_size()
    if free is not None and need * 1.3 > free:
        pytest.skip(f"{need / 2**30:.1f} GiB of gradients do not fit in {free / 2**30:.1f} GiB")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return [
        torch.randn(n, device=DEVICE, generator=gen).to(dtype) for n in _sizes(n_tensors, total)
    ]


def _torch_two_pass(grads: list[torch.Tensor], inv: torch.Tensor):
    found = torch.zeros((), device=inv.device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return found, torch.linalg.vector_norm(torch.stack(norms))


def _fastpar(grads: list[torch.Tensor], inv: torch.Tensor):
    found, sumsq, _ = unscale_and_norm(grads, inv)
    return found, sumsq.sqrt()


def _loop(grads: list[torch.Tensor], inv: torch.Tensor):
    norms = []
    for g in grads:
        g.mul_(inv)
        norms.append(torch.linalg.vector_norm(g, dtype=torch.float32))
    total = torch.linalg.vector_norm(torch.stack(norms))
    return (~torch.isfinite(total)).float(), total


def _read_only(grads: list[torch.Tensor], inv: torch.Tensor):
    found, sumsq, _ = norm_and_inf(grads, inv)
    return found, sumsq.sqrt()


FNS = {"torch_two_pass": _torch_two_pass, "fastpar": _fastpar, "loop": _loop}
FNS["fastpar_read_only"] = _read_only


@pytest.mark.parametrize(
    ("provider", "n_tensors", "total", "dtype"),
    CASES,
    ids=[f"{p}-T{t}-E{int(e):.0e}-{d}".replace("+0", "") for p, t, e, d in CASES],
)
def test_unscale_norm(benchmark, provider, n_tensors, total, dtype):
    total = int(total)
    grads = _make_grads(n_tensors, total, DTYPES[dtype])
    inv = torch.tensor(0.5, device=DEVICE)
    fn = FNS[provider]
    group = f"unscale_norm-{dtype}-T{n_tensors}-E{total:.0e}"

    def run():
        out = fn(grads, inv)
        if CUDA:
            torch.cuda.synchronize()
        return out

    found, norm = run()  # warm-up: compiles the kernel; checks the provider works
    assert float(found) == 0.0 and float(norm) > 0.0
    benchmark.group = group
    passes = 1 if provider == "fastpar_read_only" else 2  # read once (+ write once)
    moved = passes * sum(g.numel() * g.element_size() for g in grads)
    benchmark.extra_info.update(
        provider=provider,
        n_tensors=n_tensors,
        elements=total,
        dtype=dtype,
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
        compulsory_bytes=moved,
    )
    # inv_scale 0.5 a call: ~15 calls stay far from fp32 / bf16 subnormals (values ~ 2^-15).
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)

    record_bandwidth(benchmark, moved)
    median = benchmark.stats.stats.median
    if provider == "torch_two_pass":
        _MEDIANS[group] = median
    elif group in _MEDIANS:
        benchmark.extra_info["time_vs_torch_two_pass"] = median / _MEDIANS[group]


TABLE_TENSORS = 200  # the measurement: 200 gradient tensors


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "uncached"])
def test_launch_host_time(benchmark, monkeypatch, cache):
    """Host time of one ``unscale_stats`` launcher call over 200 tensors with the kernel
    replaced by a no-op: pointer reads, grouping, the table (looked up, or built, pinned and
    copied every call with the cache off) and the two partial buffers. No kernel runs."""
    from fastpar.kernels import unscale_norm as k  # imports triton: only for this benchmark

    class _NoKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(k, "_unscale_norm_kernel", _NoKernel())
    monkeypatch.setattr(k, "TABLE_CACHE_SIZE", k.TABLE_CACHE_SIZE if cache else 0)
    grads = [torch.zeros(1000 + 37 * i, device=DEVICE) for i in range(TABLE_TENSORS)]
    inv = torch.tensor(0.5, device=DEVICE)

    def run():
        k.unscale_stats(grads, grads, inv)

    k._TABLES.clear()
    run()
    benchmark.group = f"unscale_norm-launch-host-T{TABLE_TENSORS}"
    benchmark.extra_info.update(cache=cache, tensors=TABLE_TENSORS, device=DEVICE)
    benchmark.pedantic(run, rounds=100, warmup_rounds=5)
    k._TABLES.clear()


STEP_ELEMENTS = 1 << 24 if CUDA else 1 << 21
_STEP_MEDIANS: dict[str, float] = {}


@pytest.mark.parametrize("fold", [False, True], ids=["unscaling", "folded"])
def test_mixed_precision_step(benchmark, fold):
    """One ``MixedPrecisionOptimizer`` step over ``FusedAdamW`` on a bf16 model (64 tensors,
    dynamic loss scaling, clipping to 1.0): the unscaling step beside the folded one.
    ``grad_bytes``: the compulsory gradient traffic of the step, 10 vs 4 B an element."""
    sizes = _sizes(64, STEP_ELEMENTS)
    params = [
        torch.nn.Parameter(torch.zeros(n, device=DEVICE, dtype=torch.bfloat16)) for n in sizes
    ]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, device=DEVICE, generator=gen).bfloat16()
    opt = MixedPrecisionOptimizer(
        FusedAdamW(params, lr=1e-4),
        scaler=DynamicLossScaler(initial_scale=1.0, growth_interval=10**9),
        max_grad_norm=1.0,
        fold_unscale=fold,
    )

    def run():
        out = opt.step()
        if CUDA:
            torch.cuda.synchronize()
        return out

    skipped, _ = run()
    assert not bool(skipped)
    group = f"mp-step-bf16-E{STEP_ELEMENTS:.0e}"
    benchmark.group = group
    grad_bytes = (4 if fold else 10) * STEP_ELEMENTS
    benchmark.extra_info.update(
        fold=fold,
        elements=STEP_ELEMENTS,
        grad_bytes=grad_bytes,
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
    )
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    median = benchmark.stats.stats.median
    if not fold:
        _STEP_MEDIANS[group] = median
    elif group in _STEP_MEDIANS:
        benchmark.extra_info["time_vs_unscaling"] = median / _STEP_MEDIANS[group]
