"""fastpar's fp8 scaling against a real peer: torchao's float8 training (``torchao.float8``, the
``peers`` extra; it runs on CPU through torch._scaled_mm's CPU kernels). torchao's dynamic
cast of one tensor and ``fastpar.ops.fp8.quantize`` give the same scales and the same fp8 bytes,
for each recipe torchao shares with fastpar (tensorwise and rowwise; blockwise has no torchao
float8 counterpart) and each operand role, in fp32 and bf16; and torchao's ``Float8Linear`` and
``fastpar.ops.fp8_linear.fp8_linear`` give the same output and gradients."""

from __future__ import annotations

import pytest
import torch

from fastpar.ops.fp8 import Fp8Recipe, quantize

ao = pytest.importorskip("torchao.float8.float8_scaling_utils", reason="the peers extra")
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402

ROLES = {"activation": "input", "weight": "weight", "grad": "grad_output"}
AO_ROLE = {
    "activation": GemmInputRole.INPUT,
    "weight": GemmInputRole.WEIGHT,
    "grad": GemmInputRole.GRAD_OUTPUT,
}


def _torchao_cast(x: torch.Tensor, recipe: str, role: str):
    """torchao's cast of ``x`` (reduction dim last) as its recipe ``recipe`` casts ``role``."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    cast = getattr(config, f"cast_config_{ROLES[role]}")
    rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    return ao.hp_tensor_to_float8_dynamic(
        x,
        cast.target_dtype,
        LinearMMConfig(),
        gemm_input_role=AO_ROLE[role],
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=-1 if rowwise else None,
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_quantize_equals_torchao_dynamic_cast(recipe, role, dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(48, 256, generator=g) * torch.logspace(-3, 3, 48).unsqueeze(1)).to(dtype)
    x[5, 17] = 0.0  # an exact zero, and a row near fp8's top after scaling
    theirs = _torchao_cast(x, recipe, role)
    ours = quantize(x, recipe, role)
    assert ours.data.dtype == theirs._data.dtype == Fp8Recipe(recipe).dtype(role)
    assert ours.scale.dtype == theirs._scale.dtype == torch.float32
    assert torch.equal(theirs._scale.reshape(ours.scale.shape), ours.scale)
    assert torch.equal(theirs._data.view(torch.uint8), ours.data.view(torch.uint8))


def test_a_different_rounding_of_the_scale_is_seen():
    """The comparison can fail: torchao without its power-of-two rounding differs from
    fastpar's rowwise recipe (which rounds, as torchao's own rowwise recipe does)."""
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * 3
    theirs = ao.hp_tensor_to_float8_dynamic(
        x,
        torch.float8_e4m3fn,
        LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=-1,
        round_scales_to_power_of_2=False,
    )
    ours = quantize(x, "rowwise", "activation")
    assert not torch.equal(theirs._scale.reshape(ours.scale.shape), ours.scale)


def _linear_pair(recipe: str, dtype: torch.dtype, seed: int = 3):
    """torchao's Float8Linear and fastpar's fp8_linear on the same weight, input and output
    gradient: ((y, dx, dw) of torchao, the same of fastpar)."""
    import copy

    from torchao.float8 import convert_to_float8_training

    from fastpar.ops.fp8_linear import fp8_linear

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(256, 128, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(128, 256, generator=g) * 0.05)
    lin = lin.to(dtype)
    config = Float8LinearConfig.from_recipe_name(recipe)
    theirs = convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(lin)), config=config)
    x = (torch.randn(64, 256, generator=g) * 2).to(dtype)
    gy = torch.randn(64, 128, generator=g).to(dtype)
    x1 = x.clone().requires_grad_()
    y1 = theirs(x1)
    y1.backward(gy)
    w2, x2 = lin.weight.detach().clone().requires_grad_(), x.clone().requires_grad_()
    y2 = fp8_linear(x2, w2, recipe)
    y2.backward(gy)
    return (y1.detach(), x1.grad, theirs[0].weight.grad), (y2.detach(), x2.grad, w2.grad)


@pytest.mark.parametrize(
    ("recipe", "dtype"),
    [("tensorwise", torch.float32), ("tensorwise", torch.bfloat16), ("rowwise", torch.bfloat16)],
)
def test_the_fp8_linear_equals_torchaos_float8_linear(recipe, dtype):
    """Output, input gradient and weight gradient, bit for bit (the same scales, fp8 bytes and
    torch._scaled_mm calls)."""
    theirs, ours = _linear_pair(recipe, dtype)
    for name, a, b in zip(("output", "input grad", "weight grad"), theirs, ours, strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), name


def test_torchaos_rowwise_fp32_linear_is_fastpars_rounded_to_bf16():
    """torchao's rowwise GEMMs with fp32 operands ask torch._scaled_mm for a bf16 result (its
    float8_ops.py: _scaled_mm had no fp32 output for rowwise scaling) and upcast it; fastpar keeps
    the fp32 result. Rounded to bf16, fastpar's equal torchao's bit for bit; unrounded they
    differ (so the comparison can fail)."""
    theirs, ours = _linear_pair("rowwise", torch.float32)
    for name, a, b in zip(("output", "input grad", "weight grad"), theirs, ours, strict=True):
        assert torch.equal(a, b.bfloat16().float()), name
    assert not torch.equal(theirs[0], ours[0])
