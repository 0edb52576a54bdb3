"""A linear layer's step (forward and backward: the three GEMMs) in fp8 against bf16, side by
side: ``torch.nn.functional.linear`` in bf16 (the PyTorch-native peer) and
``fastpar.ops.fp8_linear.fp8_linear`` with each recipe (quantize every operand, then
``torch._scaled_mm`` where it runs, the exact emulation where it does not: blockwise always).
Tokens 2048 (512 on a CPU), in 1024 -> out 1024 (a GPU: 4096 -> 4096).

On a CPU a speed-up is not expected: torch 2.13's CPU ``_scaled_mm`` has no fp8 matrix units
to use, and the quantization is extra passes over each operand; the ratio to bf16
(``time_vs_bf16``, > 1 is slower) is reported as measured. On a GPU (``bench/gpu_check.py``
runs ``test_bench_train_gpu.py`` for the training step) the same file gives the layer's ratio.
Run:  pytest bench/test_bench_fp8_linear.py --benchmark-json=bench/results/fp8_linear.json
"""

from __future__ import annotations

import pytest
import torch

from fastpar.ops.fp8_linear import fp8_linear

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOKENS, IN, OUT = (2048, 4096, 4096) if CUDA else (512, 1024, 1024)
CASES = ("bf16", "tensorwise", "rowwise", "blockwise")  # bf16 first: the ratios
ROUNDS = 20 if CUDA else 5
_MEDIANS: dict[str, float] = {}


def _step(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, case: str) -> None:
    y = torch.nn.functional.linear(x, w) if case == "bf16" else fp8_linear(x, w, case)
    y.backward(g)
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("case", CASES)
def test_linear_step(benchmark, case):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(TOKENS, IN, device=DEVICE, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(OUT, IN, device=DEVICE, generator=gen) * IN**-0.5).bfloat16()
    w.requires_grad_()
    g = torch.randn(TOKENS, OUT, device=DEVICE, generator=gen).bfloat16()
    benchmark.group = "fp8-linear-step"
    benchmark.pedantic(_step, args=(x, w, g, case), rounds=ROUNDS, warmup_rounds=1)
    median = benchmark.stats.stats.median
    _MEDIANS[case] = median
    flops = 6 * TOKENS * IN * OUT  # forward, input gradient, weight gradient
    info = {"tflops": flops / median / 1e12, "shape": [TOKENS, IN, OUT]}
    if "bf16" in _MEDIANS:
        info["time_vs_bf16"] = median / _MEDIANS["bf16"]
    benchmark.extra_info.update(info)
