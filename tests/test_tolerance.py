"""fastpar.tolerance's element rules against plain definitions: the float64 difference with
its special values (equal infinities and NaN-for-NaN are 0, non-finite against finite is inf),
the largest finite magnitude, the worst element of ``compare``, and ``nudge``'s one-ulp twin."""

from __future__ import annotations

import math

import pytest
import torch

from fastpar import tolerance


def _errors(x, exact):  # the definition, element by element
    out = []
    for a, b in zip(
        x.double().reshape(-1).tolist(), exact.double().reshape(-1).tolist(), strict=True
    ):
        if a == b or (math.isnan(a) and math.isnan(b)):
            out.append(0.0)
        elif math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
            out.append(math.inf)
        else:
            out.append(abs(a - b))
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def _cases():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(7, 5, generator=g, dtype=torch.float64)
    x = (exact + 1e-6 * torch.randn(7, 5, generator=g, dtype=torch.float64)).float()
    yield "finite", x, exact
    special = exact.clone()
    special[0, 0], special[1, 1], special[2, 2] = math.inf, -math.inf, math.nan
    x2 = x.clone()
    x2[0, 0], x2[1, 1], x2[2, 2] = math.inf, 1.0, math.nan  # equal inf, finite vs -inf, NaN-NaN
    yield "special", x2, special
    x3 = x.clone()
    x3[4, 4] = math.nan  # NaN against a finite value
    yield "nan", x3, exact
    yield "empty", torch.zeros(0), torch.zeros(0, dtype=torch.float64)
    # longer than max_error's chunks (2^16), the special values in the later ones
    n = 3 * 2**16 + 5
    exact = torch.randn(n, generator=g, dtype=torch.float64)
    x4 = (exact + 1e-6 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    x4[2**16 + 3] = 7.0  # the largest error, in the second chunk
    yield "chunks", x4, exact
    x5, special = x4.clone(), exact.clone()
    special[2**17 + 1], x5[3 * 2**16 + 4] = math.inf, math.nan  # in the third and the last
    yield "chunks-special", x5, special


CASES = ["finite", "special", "nan", "empty", "chunks", "chunks-special"]


@pytest.mark.parametrize("case", CASES)
def test_errors_magnitude_and_compare_follow_their_definitions(case):
    _, x, exact = next(c for c in _cases() if c[0] == case)
    want = _errors(x, exact)
    got = tolerance.errors(x, exact)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert tolerance.max_error(x, exact) == (float(want.max()) if want.numel() else 0.0)
    finite = exact[torch.isfinite(exact)]
    assert tolerance.magnitude(exact) == (float(finite.abs().max()) if finite.numel() else 0.0)
    single = (exact + 1e-7).float()
    c = tolerance.compare(x, single, exact, length=16, what="q")
    if want.numel():
        e_single = tolerance.max_error(single, exact)
        bound = c.factor * e_single + c.floor
        ratio = want.reshape(-1) / bound
        assert c.error == float(want.reshape(-1)[int(ratio.argmax())])
        assert c.single_error == e_single and c.ok == (float(want.max()) <= bound)
    # a slack per element: the worst element is the largest error / (bound + its slack)
    if want.numel():
        slack = torch.rand(exact.shape, dtype=torch.float64)
        c2 = tolerance.compare(x, single, exact, length=16, slack=slack)
        bound2 = (c2.factor * c2.single_error + c2.floor + slack).reshape(-1)
        at = int((want.reshape(-1) / bound2).argmax())
        assert c2.error == float(want.reshape(-1)[at]) and c2.slack == float(slack.reshape(-1)[at])


def test_a_zero_bound_reports_the_first_nonzero_error():
    exact = torch.zeros(4, dtype=torch.float64)
    x = torch.tensor([0.0, 2.0, 0.0, 3.0])
    c = tolerance.compare(x, torch.zeros(4), exact, length=1, factor=0.0)
    assert c.floor == 0.0 and c.error == 2.0 and not c.ok  # magnitude 0: no floor
    assert tolerance.compare(torch.zeros(4), torch.zeros(4), exact, factor=0.0).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nudge_moves_every_value_one_ulp_with_fair_coin_draws(dtype):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    twin = t.clone()
    tolerance.nudge([twin], seed=3)
    up = torch.randint(0, 2, t.shape, generator=torch.Generator().manual_seed(3)).bool()
    work = t.float() if dtype == torch.bfloat16 else t
    if dtype == torch.bfloat16:
        ulp = torch.finfo(dtype).eps * work.abs()
        want = (work + torch.where(up, ulp, -ulp)).to(dtype)
    else:
        want = torch.nextafter(t, torch.where(up, math.inf, -math.inf).to(dtype))
    assert torch.equal(twin, want) and bool((twin != t).all())
