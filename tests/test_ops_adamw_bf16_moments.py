"""AdamW with bf16 moments: exp_avg and exp_avg_sq stored in bf16, updated in
fp32 (the param from the unrounded values), stored rounded to nearest even.

* CPU tier: the reference path equals fp32 moments rounded to bf16 after every step (an
  emulation with torch ops), flat and multi-tensor, mixed with fp32-moment tensors; a skipped
  step writes nothing; mismatched moment dtypes are refused.
* Interpreter tier: the flat and multi-tensor kernels, moments bit-identical to the emulation
  with truncation (how the interpreter stores bf16), params by the rule.
* GPU tier: the kernels natively, moments bit-identical to the reference path (round to nearest
  even), params by the rule.

The moments do not depend on the param: the kernels compute them with the reference's fp32
operations in torch's order (an fma for the lerp and for v·β2 + (1 − β2)·g·g) and round them
once, so they are compared bit for bit wherever torch's CPU kernels round each multiply-add once
too (``tests/_adamw.py``'s ``same_fmas``; its portable kernels, ``ATEN_CPU_CAPABILITY=default``,
do not: there the moments are judged by the rule). The params are judged by the rule of
``fastpar.tolerance`` (``_parity.agree``, length 1: an elementwise update): their error against
the same steps in float64 driven by the moments the kernels stored before each step (rounding
them is part of what they compute; ``fastpar.reference.adamw`` computes in fp32 whatever its
inputs, so a float64 run of it is not exact: the update is written out in float64 here) at most
4 x the reference path's own + a floor.
"""

from __future__ import annotations

import pytest
import torch
from _adamw import exact_adamw_step, same_fmas
from _parity import agree

from fastpar.ops import adamw as op
from fastpar.ops import backend
from fastpar.reference import adamw as ref

HYPER = dict(lr=1e-2, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.1)
SIZES = [4099, 130, 1]


def _state(device="cpu", low=(True, False, True)):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(n, generator=gen).to(device) for n in SIZES]
    dtypes = [torch.bfloat16 if lo else torch.float32 for lo in low]
    ms = [torch.zeros(n, dtype=d, device=device) for n, d in zip(SIZES, dtypes, strict=True)]
    vs = [torch.zeros(n, dtype=d, device=device) for n, d in zip(SIZES, dtypes, strict=True)]
    return ps, ms, vs


def _grads(step: int, device="cpu"):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen).to(device) for n in SIZES]


def _run(form: str, device="cpu", steps=3, stored: list | None = None):
    """(params, exp_avgs, exp_avg_sqs) after ``steps`` steps of the op; ``stored`` receives the
    moments as stored before each step (CPU copies)."""
    ps, ms, vs = _state(device)
    step = torch.zeros((), device=device)
    for s in range(steps):
        if stored is not None:
            stored.append(([m.cpu().clone() for m in ms], [v.cpu().clone() for v in vs]))
        step += 1
        gs = _grads(s, device)
        if form == "multi":
            op.adamw_step_multi_(ps, gs, ms, vs, steps=step, **HYPER)
        else:
            for p, g, m, v in zip(ps, gs, ms, vs, strict=True):
                op.adamw_step_(p, g, m, v, step=step, **HYPER)
    return ps, ms, vs


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (how the interpreter stores bf16)."""
    return (t.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def _emulated(steps=3, truncate=False):
    """fp32 moments through the reference, rounded to bf16 after each step where stored so
    (to nearest even, or by truncation as the interpreter does)."""
    ps, ms, vs = _state()
    step = torch.zeros(())
    for s in range(steps):
        step += 1
        for i, (p, g) in enumerate(zip(ps, _grads(s), strict=True)):
            m32, v32 = ms[i].float(), vs[i].float()
            ref.adamw_step_(p, g, m32, v32, step=step, **HYPER)
            low = ms[i].dtype == torch.bfloat16
            cast = _truncated if truncate and low else (lambda t, d=ms[i].dtype: t.to(d))
            ms[i], vs[i] = cast(m32), cast(v32)
    return ps, ms, vs


def _exact(stored: list) -> tuple[list, list, list]:
    """The same steps in float64 (the update written out), each step from the moments a run
    stored before it: the final (params, exp_avgs, exp_avg_sqs)."""
    p64 = [p.double() for p in _state()[0]]
    m64 = v64 = []
    for s, (ms, vs) in enumerate(stored):
        rows = zip(p64, ms, vs, _grads(s), strict=True)
        steps = [
            exact_adamw_step(p, m.double(), v.double(), g.double(), s + 1, **HYPER)
            for p, m, v, g in rows
        ]
        p64, m64, v64 = (list(t) for t in zip(*steps, strict=True))
    return p64, m64, v64


@pytest.mark.parametrize("form", ["flat", "multi"])
def test_reference_path_rounds_the_moments_every_step(form):
    with backend.use_backend("reference"):
        got = _run(form)
    want = _emulated()
    for a, b in zip([t for ts in got for t in ts], [t for ts in want for t in ts], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[1][0].dtype == torch.bfloat16 and got[1][1].dtype == torch.float32


def test_a_skipped_step_writes_nothing_and_bad_dtypes_are_refused():
    ps, ms, vs = _state()
    ms[0].fill_(0.3)
    before = [t.clone() for t in (ps[0], ms[0], vs[0])]
    op.adamw_step_(
        ps[0],
        torch.full_like(ps[0], float("inf")),
        ms[0],
        vs[0],
        step=torch.ones(()),
        found_inf=torch.ones(()),
        **HYPER,
    )
    for a, b in zip((ps[0], ms[0], vs[0]), before, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="the moments must both be fp32 or both bf16"):
        op.adamw_step_(ps[0], ps[0], ms[0], vs[0].float(), step=torch.ones(()), **HYPER)
    with pytest.raises(TypeError, match="the moments must both be fp32 or both bf16"):
        op.adamw_step_(ps[0], ps[0], ms[0].half(), vs[0].half(), step=torch.ones(()), **HYPER)


def _compare(got, want, exact) -> None:
    """Params by the rule against float64 (the kernels' IEEE sqrt against the CPU's moves them
    by an ulp now and then); moments bit for bit (they do not depend on the param: the same
    fp32 operations in the same order, rounded once) where torch's CPU multiply-adds round
    once like the kernels' (``same_fmas``), else by the rule in their storage dtype."""
    for i, (a, b, c) in enumerate(zip(got[0], want[0], exact[0], strict=True)):
        agree(a, b, c, f"param {i}", length=1)
    for k, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
        for i, (a, b, c) in enumerate(zip(got[k], want[k], exact[k], strict=True)):
            assert a.dtype == b.dtype, (name, i)
            if same_fmas():
                assert torch.equal(a, b), f"{name} {i}: not bit for bit the reference path's"
            else:
                agree(a, b, c, f"{name} {i}", length=1, dtype=a.dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["flat", "multi"])
def test_kernels_interpreted_match_the_reference_path(form):
    stored: list = []
    with backend.use_backend("triton"):
        got = _run(form, stored=stored)
    _compare(got, _emulated(truncate=True), _exact(stored))


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["flat", "multi"])
def test_kernels_on_a_gpu_match_the_reference_path(form):
    stored: list = []
    got = _run(form, "cuda", stored=stored)
    _compare([[t.cpu() for t in ts] for ts in got], _emulated(), _exact(stored))
