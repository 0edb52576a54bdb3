"""CPU tier of ``fastpar.ops.unscale_norm``: the reference path against explicit float64 math.

The oracle never calls the code under test: expected stored values are
``(float64(g) · inv_scale)`` rounded to fp32 (exact: a product of two fp32 numbers fits in a
float64, and one IEEE fp32 product is that value correctly rounded on every machine) and then
to the destination's dtype, compared bit for bit; the max |·| and the inf/NaN flag of those
values are exact too. The sum of squares, a sum of every element, is judged by the rule of
``fastpar.tolerance`` (``_parity.agree``): against the float64 sum, within 4 x the error of an
fp32 torch sum of the same stored values + a floor, not within a fixed tolerance.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from _parity import agree

from fastpar.ops import backend
from fastpar.ops import unscale_norm as op

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grads(n: int, seed: int, max_numel: int = 3000) -> list[torch.Tensor]:
    """``n`` tensors of random sizes and mixed dtypes; always an empty one and a size-1 one."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i == 0 and n > 2:
            shape: tuple[int, ...] = (0, 3)
        elif i == 1 and n > 2:
            shape = (1,)
        else:
            numel = int(torch.randint(0, max_numel, (1,), generator=gen))
            shape = (numel,) if i % 2 else (1, numel)
        dtype = DTYPES[int(torch.randint(0, 3, (1,), generator=gen))]
        out.append((torch.randn(shape, generator=gen) * 100).to(dtype))
    return out


def _expected(
    grads: list[torch.Tensor], inv: float, out_dtypes: list[torch.dtype]
) -> tuple[list[torch.Tensor], float, tuple[torch.Tensor, torch.Tensor, int], float]:
    """(stored values, found_inf, sum of squares, max |y|) from float64 math; the sum of squares
    as (fp32 torch sum of the stored values, float64 sum, number of terms) for the rule."""
    stored = [(g.double() * inv).float().to(dt) for g, dt in zip(grads, out_dtypes, strict=True)]
    found = float(not all(bool(torch.isfinite(s).all()) for s in stored))
    nonempty = [s for s in stored if s.numel()]
    if not nonempty:
        return stored, found, (torch.zeros(()), torch.zeros((), dtype=torch.float64), 1), 0.0
    single = torch.stack([s.float().square().sum() for s in nonempty]).sum()
    exact = torch.stack([s.double().square().sum() for s in nonempty]).sum()
    amax = float(torch.stack([s.double().abs().max() for s in nonempty]).max())
    return stored, found, (single, exact, sum(s.numel() for s in nonempty)), amax


def _same(a: float, b: float) -> bool:
    """Equal, NaN matching NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN where the other has NaN."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0))


def _check_stats(result, expected) -> None:
    found, sumsq, amax = result
    _, e_found, (s_single, s_exact, n), e_max = expected
    for t in result:
        assert t.shape == () and t.dtype == torch.float32
    assert float(found) == e_found
    agree(sumsq, s_single, s_exact, "sum of squares", length=n)  # inf / NaN only as the exact
    assert _same(float(amax), e_max), (float(amax), e_max)  # a max: exact


def _run(grads, inv_scale, mode, **kw):
    """Run the op on clones; return (result, written tensors, grads after the call)."""
    grads = [g.clone() for g in grads]
    if mode == "inplace":
        return op.unscale_and_norm(grads, inv_scale, **kw), grads, grads
    outs = [torch.full(g.shape, 7.0) for g in grads]
    return op.unscale_and_norm(grads, inv_scale, out=outs, **kw), outs, grads


@pytest.mark.parametrize("mode", ["inplace", "out"])
@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
@pytest.mark.parametrize("inv_kind", ["tensor", "float"])
def test_matches_float64_math(n, mode, inv_kind):
    grads = _grads(n, seed=n, max_numel=3000 if n < 1000 else 200)
    inv = 1.0 / 3.0 if inv_kind == "float" else torch.tensor(2.0**-7)
    inv_f = float(torch.tensor(float(inv), dtype=torch.float32))
    dtypes = [g.dtype for g in grads] if mode == "inplace" else [torch.float32] * n
    expected = _expected(grads, inv_f, dtypes)
    result, written, after = _run(grads, inv, mode)
    _check_stats(result, expected)
    for w, e in zip(written, expected[0], strict=True):
        assert w.dtype == e.dtype and torch.equal(w, e)
    if mode == "out":
        assert all(torch.equal(a, g) for a, g in zip(after, grads, strict=True))  # grads untouched


@pytest.mark.parametrize("mode", ["inplace", "out"])
def test_nan_in_last_element_of_last_tensor(mode):
    grads = _grads(20, seed=3)
    grads[-1] = torch.randn(513).to(torch.bfloat16)
    grads[-1][-1] = float("nan")
    result, written, _ = _run(grads, 0.5, mode)
    found, sumsq, amax = result
    assert float(found) == 1.0 and math.isnan(float(sumsq)) and math.isnan(float(amax))
    dtypes = [w.dtype for w in written]
    for w, e in zip(written, _expected(grads, 0.5, dtypes)[0], strict=True):
        assert _equal_nan(w, e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf(dtype):
    grads = _grads(5, seed=4)
    grads[2] = torch.ones(300, dtype=dtype)
    grads[2][150] = float("-inf")
    result, _, _ = _run(grads, 0.25, "inplace")
    _check_stats(result, _expected(grads, 0.25, [g.dtype for g in grads]))
    assert float(result[0]) == 1.0 and float(result[2]) == math.inf


def test_inf_created_by_multiplication():
    # fp32: 1e38 · 10 overflows fp32 although the input is finite.
    grads = [torch.tensor([1.0, 1e38, -2.0])]
    result, written, _ = _run(grads, 10.0, "inplace")
    assert float(result[0]) == 1.0 and float(result[2]) == math.inf
    assert written[0][1] == math.inf
    # fp16 in place: 6e4 · 2 = 1.2e5 does not fit fp16 (max 65504) → inf is stored and caught.
    grads = [torch.randn(10).half(), torch.tensor([6e4, 1.0], dtype=torch.float16)]
    result, written, _ = _run(grads, 2.0, "inplace")
    assert float(result[0]) == 1.0 and written[1][0] == math.inf
    # ... but written into fp32 main grads it is finite: no flag.
    result, written, _ = _run(grads, 2.0, "out")
    _check_stats(result, _expected(grads, 2.0, [torch.float32] * 2))
    assert float(result[0]) == 0.0 and float(written[1][0]) == 1.2e5


def test_found_inf_accumulates_and_is_never_reset():
    grads = _grads(10, seed=5)
    flag = torch.ones(())
    found, _, _ = op.unscale_and_norm([g.clone() for g in grads], 1.0, found_inf=flag)
    assert found is flag and float(flag) == 1.0  # clean grads: stays 1
    flag = torch.zeros(())
    bad = [g.clone() for g in grads] + [torch.tensor([float("nan")])]
    op.unscale_and_norm(bad, 1.0, found_inf=flag)
    assert float(flag) == 1.0
    op.unscale_and_norm([g.clone() for g in grads], 1.0, found_inf=flag)
    assert float(flag) == 1.0  # a later clean call does not reset it
    flag = torch.zeros(())
    op.unscale_and_norm([g.clone() for g in grads], 1.0, found_inf=flag)
    assert float(flag) == 0.0


def test_norm_false_and_empty():
    grads = _grads(10, seed=6)
    result, _, _ = _run(grads, 0.5, "inplace", norm=False)
    e = _expected(grads, 0.5, [g.dtype for g in grads])
    assert float(result[1]) == 0.0 and float(result[2]) == e[3] and float(result[0]) == 0.0
    found, sumsq, amax = op.unscale_and_norm([], 0.5)
    assert (float(found), float(sumsq), float(amax)) == (0.0, 0.0, 0.0)
    found, sumsq, amax = op.unscale_and_norm([torch.empty(0), torch.empty(0, 4)], 0.5)
    assert (float(found), float(sumsq), float(amax)) == (0.0, 0.0, 0.0)
    flag = torch.ones(())
    assert op.unscale_and_norm([], 0.5, found_inf=flag)[0] is flag and float(flag) == 1.0


def test_non_contiguous_grads():
    base = torch.randn(64, 48)
    grads = [base.clone().t(), torch.randn(33)[::2].clone(), torch.randn(5, 7)]
    expected = _expected(grads, 0.125, [torch.float32] * 3)
    result, written, _ = _run(grads, 0.125, "inplace")
    _check_stats(result, expected)
    assert all(torch.equal(w, e) for w, e in zip(written, expected[0], strict=True))


def test_clip_coefficient_and_scale():
    coef = op.clip_coefficient(torch.tensor(10.0), 1.0)
    assert coef.shape == () and float(coef) == pytest.approx(1.0 / (10.0 + 1e-6), rel=1e-7)
    assert float(op.clip_coefficient(torch.tensor(0.5), 1.0)) == 1.0  # norm < max: no clip
    assert float(op.clip_coefficient(torch.tensor(0.0), 1.0, eps=1e-6)) == 1.0
    assert math.isnan(float(op.clip_coefficient(torch.tensor(float("nan")), 1.0)))
    assert float(op.clip_coefficient(torch.tensor(3.0), torch.tensor(1.5), eps=0.0)) == 0.5

    grads = _grads(30, seed=7)
    kept = [g.clone() for g in grads]
    op.scale_(grads, op.clip_coefficient(torch.tensor(0.5), 1.0))  # coef 1: a no-op
    assert all(torch.equal(g, k) for g, k in zip(grads, kept, strict=True))
    c = 0.3
    op.scale_(grads, torch.tensor(c))
    for g, k in zip(grads, kept, strict=True):  # one IEEE product: exact on every machine
        assert torch.equal(g, (k.double() * float(torch.tensor(c))).float().to(k.dtype))


def test_clip_end_to_end_matches_torch_clip_grad_norm():
    """Unscale, norm and clip against torch's clip_grad_norm_ (fp32) and the same math in
    float64, by the rule (the norm sums every element)."""
    grads = [torch.randn(100) * 3, torch.randn(10, 10), torch.randn(1)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone() * 0.5
    torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    mine = [g.clone() for g in grads]
    _, sumsq, _ = op.unscale_and_norm(mine, 0.5)
    op.scale_(mine, op.clip_coefficient(sumsq.sqrt(), 1.0))
    exact = [g.double() * 0.5 for g in grads]
    norm = torch.stack([e.square().sum() for e in exact]).sum().sqrt()
    coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    n = sum(g.numel() for g in grads)
    for i, (m, p, e) in enumerate(zip(mine, params, exact, strict=True)):
        agree(m, p.grad, e * coef, f"clipped gradient {i}", length=n)


def test_validation():
    with pytest.raises(TypeError, match="float32"):
        op.unscale_and_norm([torch.ones(3, dtype=torch.int32)], 1.0)
    with pytest.raises(ValueError, match="one per grad"):
        op.unscale_and_norm([torch.ones(3)], 1.0, out=[])
    with pytest.raises(ValueError, match="shape"):
        op.unscale_and_norm([torch.ones(3)], 1.0, out=[torch.ones(4)])
    with pytest.raises(ValueError, match="one value"):
        op.unscale_and_norm([torch.ones(3)], torch.ones(2))


def test_dispatch_and_lazy_triton_import():
    assert "unscale_norm" in backend.registered_ops()
    assert backend.select("unscale_norm", "cpu") == "reference"
    if backend.triton_status()[0]:
        assert backend.select("unscale_norm", "cuda") == "triton"
    code = (
        "import sys, fastpar, fastpar.ops.unscale_norm as m, torch;"
        "m.unscale_and_norm([torch.ones(3)], 0.5);"
        "assert 'triton' not in sys.modules, 'triton imported';"
        "assert 'fastpar.kernels.unscale_norm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- the read-only pass -------------------------------------------------------------------------


def _read(grads, inv_scale, **kw):
    """``norm_and_inf`` on clones; asserts nothing was written."""
    clones = [g.clone() for g in grads]
    result = op.norm_and_inf(clones, inv_scale, **kw)
    assert all(_equal_nan(c, g) for c, g in zip(clones, grads, strict=True))
    return result


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
def test_read_only_matches_float64_and_the_writing_pass_bit_for_bit(n):
    grads = _grads(n, seed=10 + n)
    inv = torch.tensor(1.0 / 3.0)
    got = _read(grads, inv)
    _check_stats(got, _expected(grads, float(inv), [torch.float32] * n))
    # unscale into fp32 outs: the same three tensors, bit for bit (the same fp32 products, the
    # same per-tensor dot products and reductions: fastpar.reference.unscale_norm)
    written, _, _ = _run(grads, inv, "out")
    assert all(_equal_nan(a, b) for a, b in zip(got, written, strict=True))
    for flag_kind in (0.0, 1.0):  # a flag passed in is raised, never reset
        flag = torch.full((), flag_kind)
        assert _read(grads, 0.5, found_inf=flag)[0] is flag and float(flag) == flag_kind


def test_read_only_nan_inf_norm_false_empty_non_contiguous():
    grads = _grads(7, seed=3)
    grads[-1].view(-1)[-1] = float("nan")
    found, sumsq, amax = _read(grads, 0.5)
    assert float(found) == 1.0 and math.isnan(float(sumsq)) and math.isnan(float(amax))
    found, sumsq, amax = _read([torch.tensor([1.0, 1e38])], 10.0)  # inf made by the product
    assert float(found) == 1.0 and float(sumsq) == math.inf and float(amax) == math.inf
    found, _, amax = _read([torch.tensor([6e4], dtype=torch.float16)], 2.0)  # fp32: no overflow
    assert float(found) == 0.0 and float(amax) == 1.2e5
    assert [float(t) for t in _read([], 0.5)] == [0.0, 0.0, 0.0]
    assert [float(t) for t in _read([torch.empty(0, 4).half()], 0.5)] == [0.0, 0.0, 0.0]
    assert float(_read(_grads(7, seed=4), 0.5, norm=False)[1]) == 0.0
    strided = [torch.randn(40, 30).t(), torch.randn(9, 9)[:, ::2].bfloat16()]
    _check_stats(_read(strided, 0.25), _expected(strided, 0.25, [torch.float32] * 2))
    with backend.use_backend("reference"):
        _read(strided, 0.25)
    with pytest.raises(TypeError, match="expected float32"):
        op.norm_and_inf([torch.ones(3, dtype=torch.int32)], 1.0)
    with pytest.raises(ValueError, match="one-element tensor"):
        op.norm_and_inf([torch.ones(3)], 1.0, found_inf=torch.zeros(2))
