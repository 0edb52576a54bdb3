"""fp8 quantize (amax + scale + saturating cast + the transposed copy): provider × recipe × size.

Providers, both ``fastpar.ops.fp8.quantize(x, recipe, "activation", transpose=True)`` semantics,
ending with the fp8 tensor, its ``[C, R]`` transposed copy and their scales on the device:

* ``torch``: the pure-torch reference (``fastpar.reference.fp8.quantize``: amax, the scales in
  float64, multiply, clamp, cast, and the copy quantized from ``x.t()``), the PyTorch-native
  peer; on a CPU it is also what ``fastpar`` runs, so their ratio is about 1 there;
* ``fastpar``: the op (on a GPU the Triton amax and fused cast + transposed-copy kernels).

Sizes: on a GPU 4096² and 8192² bf16 (and 16384 x 8192); on a CPU 1024² bf16.
``extra_info``: compulsory bytes (x read once, the fp8 tensor and its copy written once: 4 B an
element of bf16; the two-pass kernels move 6), bytes/s, on a GPU the fraction of peak HBM
bandwidth, and ``time_vs_torch`` (< 1 is faster). On a CPU compare ratios, not times.

Run:  pytest bench/test_bench_fp8_cast.py --benchmark-json=bench/results/fp8_cast.json
"""

from __future__ import annotations

import pytest
import torch
from _common import record_bandwidth

from fastpar.ops import fp8 as op
from fastpar.reference import fp8 as ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PROVIDERS = ("torch", "fastpar")  # torch first: the ratios
RECIPES = ("tensorwise", "rowwise", "blockwise")
SHAPES = [(4096, 4096), (8192, 8192), (16384, 8192)] if CUDA else [(1024, 1024)]
ROUNDS, WARMUP = (20, 3) if CUDA else (5, 1)
CASES = [(p, r, s) for s in SHAPES for r in RECIPES for p in PROVIDERS]
_MEDIANS: dict[str, float] = {}


def _torch(x: torch.Tensor, recipe: op.Fp8Recipe):
    gran, dtype = recipe.granularity("activation"), recipe.dtype("activation")
    return ref.quantize(x, dtype, gran, recipe.pow2, transpose=True)


def _fastpar(x: torch.Tensor, recipe: op.Fp8Recipe):
    return op.quantize(x, recipe, "activation", transpose=True)


FNS = {"torch": _torch, "fastpar": _fastpar}


@pytest.mark.parametrize(
    ("provider", "recipe", "shape"),
    CASES,
    ids=[f"{p}-{r}-{s[0]}x{s[1]}" for p, r, s in CASES],
)
def test_fp8_quantize(benchmark, provider, recipe, shape):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(shape, device=DEVICE, generator=gen).to(torch.bfloat16)
    rec = op.Fp8Recipe(recipe)
    fn = FNS[provider]

    def run():
        out = fn(x, rec)
        if CUDA:
            torch.cuda.synchronize()
        return out

    out = run()  # warm-up: compiles the kernels; the provider gives the reference's bytes
    want = _torch(x, rec)
    assert torch.equal(out[0].view(torch.uint8), want[0].view(torch.uint8))
    group = f"fp8_quantize-{recipe}-{shape[0]}x{shape[1]}"
    benchmark.group = group
    moved = x.numel() * (x.element_size() + 2)  # read x, write the fp8 tensor and its copy
    benchmark.extra_info.update(
        provider=provider,
        recipe=recipe,
        shape=list(shape),
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
        compulsory_bytes=moved,
    )
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    record_bandwidth(benchmark, moved)
    median = benchmark.stats.stats.median
    if provider == "torch":
        _MEDIANS[group] = median
    elif group in _MEDIANS:
        benchmark.extra_info["time_vs_torch"] = median / _MEDIANS[group]
