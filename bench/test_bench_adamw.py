"""Fused AdamW over one flat shard: provider × size, one full mixed-precision optimizer step.

Every provider does the same work on an fp32 master shard with an fp32 (still scaled) gradient:
unscale (× 1/loss scale, inf check), clip (× clip coefficient), AdamW with weight decay, and a
bf16 copy of the new parameter.

* ``fastpar``: ``fastpar.ops.adamw.adamw_step_`` with inv_scale / clip_coef / found_inf /
  param_lp: one pass (Triton on a GPU, the torch reference on a CPU);
* ``torch_fused``: ``torch._amp_foreach_non_finite_check_and_unscale_``, ``torch._foreach_mul_``
  (clip), ``torch.optim.AdamW(fused=True)``, then ``copy_`` into the bf16 copy;
* ``torch_foreach``: the same with ``torch.optim.AdamW(foreach=True)``.

The scale and clip coefficient are 1.0 so that repeated rounds see the same values (the work is
the same). Sizes: 10M / 100M / 1B parameters on a GPU; 1M / 10M on a CPU (compare the providers'
ratios within one group, not absolute times). ``extra_info``: compulsory bytes (30 a parameter:
read p, g, m, v; write p, m, v and the bf16 copy) and, on an H100 / H200, the fraction of peak
HBM bandwidth (3.35 / 4.8 TB/s) at the median time.

Run:  pytest bench/test_bench_adamw.py --benchmark-json=bench/results/adamw.json
"""

from __future__ import annotations

import pytest
import torch
from _common import record_bandwidth

from fastpar.ops.adamw import adamw_step_

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    SIZES = [10_000_000, 100_000_000, 1_000_000_000]
    ROUNDS, WARMUP = 20, 3
else:
    SIZES = [1_000_000, 10_000_000]
    ROUNDS, WARMUP = 5, 1
BYTES_PER_PARAM = 30
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _step_fn(provider: str, numel: int):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    param = torch.randn(numel, device=DEVICE, generator=gen)
    grad = torch.randn(numel, device=DEVICE, generator=gen) * 1e-2
    param_lp = param.to(torch.bfloat16)
    inv_scale = torch.ones((), device=DEVICE)
    clip_coef = torch.ones((), device=DEVICE)
    found_inf = torch.zeros((), device=DEVICE)

    if provider == "fastpar":
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        step = torch.zeros((), device=DEVICE)
        beta1, beta2 = HYPER["betas"]

        def run():
            step.add_(1)
            adamw_step_(
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                lr=HYPER["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"],
                step=step,
                inv_scale=inv_scale,
                clip_coef=clip_coef,
                found_inf=found_inf,
                param_lp=param_lp,
            )

        return run

    param = torch.nn.Parameter(param)
    param.grad = grad
    kind = {"torch_fused": dict(fused=True), "torch_foreach": dict(foreach=True)}[provider]
    try:
        opt = torch.optim.AdamW([param], **HYPER, **kind)
        opt.step()  # builds the state (and checks the device supports it)
    except Exception as exc:
        pytest.skip(f"torch.optim.AdamW({kind}) fails here: {type(exc).__name__}: {exc}")

    def run():
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
        torch._foreach_mul_([grad], clip_coef)
        opt.step()
        param_lp.copy_(param.detach())

    return run


@pytest.mark.parametrize("numel", SIZES, ids=[f"N{n // 1_000_000}M" for n in SIZES])
@pytest.mark.parametrize("provider", ["fastpar", "torch_fused", "torch_foreach"])
def test_adamw_step(benchmark, provider, numel):
    step = _step_fn(provider, numel)

    def run():
        step()
        _sync()

    run()  # warm-up: compiles the kernel
    benchmark.group = f"adamw-N{numel // 1_000_000}M"
    moved = BYTES_PER_PARAM * numel
    benchmark.extra_info.update(
        provider=provider,
        numel=numel,
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
        compulsory_bytes=moved,
    )
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    record_bandwidth(benchmark, moved)


TABLE_TENSORS = 200  # the measurement: a model's worth of parameter tensors


@pytest.mark.parametrize("mode", ["rebuilt", "cached"])
def test_multi_tensor_table_prep(benchmark, mode):
    """Host time to prepare one multi-tensor launch's pointer table for 200 tensors: built,
    (pinned and) copied every step as before commit a2ef2d1 ("rebuilt"), or looked up in the cache
    by pointers and numels ("cached": what a step after the first costs). No kernel runs."""
    from fastpar.kernels import adamw as k  # imports triton: only for this benchmark

    device = torch.device(DEVICE)
    step = torch.zeros((), device=device)
    rows = []
    for i in range(TABLE_TENSORS):
        n = 1000 + 37 * i
        p = torch.zeros(n, device=device)
        rows.append((p, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), None, step))

    def rebuilt():  # pointers read, table built, pinned and copied: every step before
        pointers = [k._pointers(*row) for row in rows]
        table, _ = k._build_table(pointers, [row[0].numel() for row in rows], k.CHUNK)
        if CUDA:
            table = table.pin_memory().to(device, non_blocking=True)
        return table.to(device)

    def cached():  # pointers read, the table looked up: every step after the first
        pointers = [k._pointers(*row) for row in rows]
        return k._device_table(pointers, [row[0].numel() for row in rows], k.CHUNK, device)

    k._TABLES.clear()
    cached()  # the first step builds it
    benchmark.group = f"adamw-table-prep-T{TABLE_TENSORS}"
    benchmark.extra_info.update(mode=mode, tensors=TABLE_TENSORS, device=str(device))
    benchmark.pedantic(rebuilt if mode == "rebuilt" else cached, rounds=200, warmup_rounds=5)


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "uncached"])
def test_multi_tensor_launch_host_time(benchmark, monkeypatch, cache):
    """Host time of one ``adamw_step_multi_`` launcher call over 200 tensors with the kernel
    replaced by a no-op: pointer reads, grouping, the table (looked up, or built and copied
    every call with the cache off). What is left beside the table is Python per tensor."""
    from fastpar.kernels import adamw as k

    class _NoKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(k, "_adamw_multi_kernel", _NoKernel())
    monkeypatch.setattr(k, "TABLE_CACHE_SIZE", k.TABLE_CACHE_SIZE if cache else 0)
    device = torch.device(DEVICE)
    params = [torch.zeros(1000 + 37 * i, device=device) for i in range(TABLE_TENSORS)]
    grads, ms, vs = ([torch.zeros_like(p) for p in params] for _ in range(3))
    steps = [torch.zeros((), device=device) for _ in params]
    scalars = [torch.ones((), device=device), torch.ones((), device=device)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, steps=steps)
    kw |= dict(inv_scale=scalars[0], clip_coef=scalars[1], found_inf=torch.zeros((), device=device))

    def run():
        k.adamw_step_multi_(params, grads, ms, vs, **kw)

    k._TABLES.clear()
    run()
    benchmark.group = f"adamw-launch-host-T{TABLE_TENSORS}"
    benchmark.extra_info.update(cache=cache, tensors=TABLE_TENSORS, device=str(device))
    benchmark.pedantic(run, rounds=100, warmup_rounds=5)
    k._TABLES.clear()
