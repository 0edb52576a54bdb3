"""MoE permute / unpermute: provider × size × layout × {forward, backward} (one rank).

Providers:
* ``fastpar``: ``moe_permute`` / ``moe_unpermute`` (Triton on a GPU, the torch reference on a
  CPU). The permute forward includes the slot computation (stable sort + prefix sum).
* ``fastpar_rows``: permute forward only, the row mover alone with the slots precomputed (what
  the kernel costs without the routing bookkeeping).
* ``torch``: plain torch ops, autograd for the backward. Dropless permute:
  ``argsort(expert ids, stable) → x.index_select``; capacity permute: the same slots as fastpar,
  then ``index_copy_`` into a zeroed ``[E·C + 1, H]`` buffer; unpermute:
  ``index_add_`` of ``probs · rows`` into ``[T, H]`` (atomics on a GPU).
* ``te``: Transformer Engine's ``moe_permute`` / ``moe_unpermute`` (``map_type="index"``), GPU
  and dropless only, when ``transformer_engine`` imports.

Layouts: ``dropless`` ([T·k, H]) and ``capacity`` (factor 1.0: ``C = ceil(T·k / E)``, random
routing so some pairs drop). Sizes (tokens T, hidden H, experts E, choices k): on a GPU bf16,
a subset of 4k–64k tokens × 1k–8k hidden × 8–64 experts × k 1, 2; on a CPU fp32, two small ones
(compare the providers' ratios, not absolute times).

``extra_info``: compulsory bytes (every needed row read once, every output row written once:
permute forward ``(T + R)·H``, permute backward ``(T·k + T)·H``, unpermute forward
``(T·k + T)·H``, unpermute backward ``(T + T·k + R)·H`` elements, ``R`` the permuted rows), and
on a GPU the peak memory of one call and the fraction of peak HBM bandwidth (H200 4.8 TB/s,
H100 3.35 TB/s).

Run:  pytest bench/test_bench_moe_permute.py --benchmark-json=bench/results/moe_permute.json
"""

from __future__ import annotations

import math

import pytest
import torch
from _common import record_bandwidth, record_peak_memory

from fastpar.ops.moe_permute import _impl, moe_permute, moe_unpermute
from fastpar.reference import moe_permute as ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
if CUDA:
    SIZES = [  # (tokens, hidden, experts, k)
        (4096, 1024, 8, 1),
        (4096, 4096, 8, 2),
        (16384, 2048, 64, 2),
        (16384, 8192, 8, 2),
        (65536, 1024, 64, 2),
        (65536, 4096, 8, 1),
    ]
    ROUNDS, WARMUP = 10, 2
else:
    SIZES = [(2048, 256, 8, 2), (4096, 512, 16, 1)]
    ROUNDS, WARMUP = 15, 2  # a shared 2-core CI box is noisy: more rounds, compare minima too
SIZE_IDS = [f"T{t}-H{h}-E{e}-k{k}" for t, h, e, k in SIZES]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _te():
    if not CUDA:
        pytest.skip("Transformer Engine's permute runs on CUDA tensors only")
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # not installed, or broken
        pytest.skip(f"transformer_engine does not import: {type(exc).__name__}: {exc}")
    return te


def _data(tokens: int, hidden: int, experts: int, k: int):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE, generator=gen)
    # k distinct experts per token, like a top-k router
    ids = torch.rand(tokens, experts, device=DEVICE, generator=gen).topk(k, dim=1).indices
    probs = torch.rand(tokens, k, device=DEVICE, generator=gen)
    return x, ids, probs


def _torch_permute(x: torch.Tensor, ids: torch.Tensor, experts: int, capacity: int | None):
    """Plain-torch permute (see the module docstring); returns (rows, slots [T, k])."""
    t, k = ids.shape
    if capacity is None:
        pair = torch.argsort(ids.t().reshape(-1), stable=True)  # choice-major pairs
        slots = torch.empty_like(pair).scatter_(0, pair, torch.arange(t * k, device=x.device))
        return x.index_select(0, pair % t), slots.view(k, t).t()
    slots = ref.compute_slots(ids, experts, capacity)[0]
    rows = experts * capacity
    idx = torch.where(slots >= 0, slots, rows).reshape(-1)
    tokens = torch.arange(t, device=x.device).repeat_interleave(k)
    out = x.new_zeros(rows + 1, x.shape[1]).index_copy(0, idx, x.index_select(0, tokens))
    return out[:rows], slots


def _torch_unpermute(src: torch.Tensor, probs: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Plain-torch unpermute: ``index_add_`` of weighted rows into ``[T, H]``."""
    t, k = slots.shape
    flat = slots.reshape(-1)
    keep = flat >= 0
    idx = torch.where(keep, flat, 0)
    w = torch.where(keep, probs.reshape(-1), 0.0).to(src.dtype)
    tokens = torch.arange(t, device=src.device).repeat_interleave(k)
    rows = src.index_select(0, idx) * w[:, None]
    return src.new_zeros(t, src.shape[1]).index_add_(0, tokens, rows)


def _capacity(layout: str, tokens: int, experts: int, k: int) -> int | None:
    return None if layout == "dropless" else math.ceil(tokens * k / experts)


def _record(benchmark, run, moved: int, **info) -> None:
    benchmark.extra_info.update(
        dtype=str(DTYPE),
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
        compulsory_bytes=moved,
        **info,
    )
    record_peak_memory(benchmark, run)
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    record_bandwidth(benchmark, moved)


def _permute_fn(provider: str, experts: int, capacity: int | None, ids: torch.Tensor):
    """A callable x → permuted rows [R, H]."""
    if provider == "fastpar":
        return lambda x: moe_permute(x, ids, experts, capacity)[0]
    if provider == "torch":
        return lambda x: _torch_permute(x, ids, experts, capacity)[0]
    if provider == "te":
        te = _te()
        if capacity is not None:
            pytest.skip("Transformer Engine's index-map permute is dropless")
        ids32 = ids.to(torch.int32)
        return lambda x: te.moe_permute(x, ids32, map_type="index")[0]
    raise ValueError(provider)


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("layout", ["dropless", "capacity"])
@pytest.mark.parametrize(("tokens", "hidden", "experts", "k"), SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("provider", ["fastpar", "fastpar_rows", "torch", "te"])
def test_permute(benchmark, provider, tokens, hidden, experts, k, layout, mode):
    x, ids, _ = _data(tokens, hidden, experts, k)
    capacity = _capacity(layout, tokens, experts, k)
    out, info = moe_permute(x, ids, experts, capacity)
    rows = info.num_rows
    if provider == "fastpar_rows":
        if mode != "forward":
            pytest.skip("the row mover alone is timed forward only (backward has no routing)")
        impl = _impl("moe_permute", x)

        def run():
            out = impl.permute(x, info.slots, info.kept_counts, capacity, rows)
            _sync()
            return out

    else:
        fn = _permute_fn(provider, experts, capacity, ids)
        try:
            fn(x)  # warm-up: compiles / autotunes
            _sync()
        except Exception as exc:
            if provider == "te":
                pytest.skip(f"Transformer Engine's moe_permute fails here: {exc}")
            raise
        if mode == "forward":

            def run():
                with torch.no_grad():
                    out = fn(x)
                _sync()
                return out

        else:
            xg = x.detach().requires_grad_()
            out = fn(xg)
            grad = torch.randn_like(out)

            def run():
                res = torch.autograd.grad(out, xg, grad, retain_graph=True)
                _sync()
                return res

    elt = x.element_size() * hidden
    moved = (tokens + rows) * elt if mode == "forward" else (tokens * k + tokens) * elt
    benchmark.group = f"moe_permute-{mode}-{layout}-T{tokens}-H{hidden}-E{experts}-k{k}"
    _record(
        benchmark,
        run,
        moved,
        provider=provider,
        op="permute",
        mode=mode,
        layout=layout,
        tokens=tokens,
        hidden=hidden,
        experts=experts,
        k=k,
        dropped=int(info.num_dropped),
    )


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("layout", ["dropless", "capacity"])
@pytest.mark.parametrize(("tokens", "hidden", "experts", "k"), SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("provider", ["fastpar", "torch", "te"])
def test_unpermute(benchmark, provider, tokens, hidden, experts, k, layout, mode):
    x, ids, probs = _data(tokens, hidden, experts, k)
    capacity = _capacity(layout, tokens, experts, k)
    permuted, info = moe_permute(x, ids, experts, capacity)
    src = permuted.reshape(info.num_rows, hidden)
    if provider == "fastpar":

        def fn(s, p):
            return moe_unpermute(s.view(info.permuted_shape), p, info)

    elif provider == "torch":

        def fn(s, p):
            return _torch_unpermute(s, p, info.slots)

    elif provider == "te":
        te = _te()
        if capacity is not None:
            pytest.skip("Transformer Engine's index-map unpermute is dropless")
        src, row_map = te.moe_permute(x, ids.to(torch.int32), map_type="index")

        def fn(s, p):
            return te.moe_unpermute(s, row_map, merging_probs=p, map_type="index")

    else:
        raise ValueError(provider)
    try:
        fn(src, probs)  # warm-up
        _sync()
    except Exception as exc:
        if provider == "te":
            pytest.skip(f"Transformer Engine's moe_unpermute fails here: {exc}")
        raise

    if mode == "forward":

        def run():
            with torch.no_grad():
                out = fn(src, probs)
            _sync()
            return out

    else:
        sg = src.detach().requires_grad_()
        pg = probs.detach().requires_grad_()
        out = fn(sg, pg)
        grad = torch.randn_like(out)

        def run():
            res = torch.autograd.grad(out, (sg, pg), grad, retain_graph=True)
            _sync()
            return res

    elt = x.element_size() * hidden
    rows = info.num_rows
    reads = tokens * k if mode == "forward" else tokens + tokens * k  # rows read
    writes = tokens if mode == "forward" else rows  # rows written
    moved = (reads + writes) * elt
    benchmark.group = f"moe_unpermute-{mode}-{layout}-T{tokens}-H{hidden}-E{experts}-k{k}"
    _record(
        benchmark,
        run,
        moved,
        provider=provider,
        op="unpermute",
        mode=mode,
        layout=layout,
        tokens=tokens,
        hidden=hidden,
        experts=experts,
        k=k,
        dropped=int(info.num_dropped),
    )
