"""AdamW with bf16 moments (issue 21, item 1): exp_avg and exp_avg_sq stored in bf16, updated in
fp32 (the param from the unrounded values), stored rounded to nearest even.

* CPU tier: the reference path equals fp32 moments rounded to bf16 after every step (an
  emulation with torch ops), flat and multi-tensor, mixed with fp32-moment tensors; a skipped
  step writes nothing; mismatched moment dtypes are refused.
* Interpreter tier: the flat and multi-tensor kernels, moments bit-identical to the emulation
  with truncation (how the interpreter stores bf16), params within 1e-6 relative.
* GPU tier: the kernels natively, moments bit-identical to the reference path (round to nearest
  even), params within 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch

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


def _run(form: str, device="cpu", steps=3):
    ps, ms, vs = _state(device)
    step = torch.zeros((), device=device)
    for s in range(steps):
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
        ps[0], torch.full_like(ps[0], float("inf")), ms[0], vs[0], step=torch.ones(()),
        found_inf=torch.ones(()), **HYPER,
    )  # fmt: skip
    for a, b in zip((ps[0], ms[0], vs[0]), before, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="the moments must both be fp32 or both bf16"):
        op.adamw_step_(ps[0], ps[0], ms[0], vs[0].float(), step=torch.ones(()), **HYPER)
    with pytest.raises(TypeError, match="the moments must both be fp32 or both bf16"):
        op.adamw_step_(ps[0], ps[0], ms[0].half(), vs[0].half(), step=torch.ones(()), **HYPER)


def _compare(got, want) -> None:
    """Moments exact (they do not depend on the param); params within 1e-6 relative (the
    kernels' IEEE sqrt against the CPU's)."""
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    for a, b in zip(got[1] + got[2], want[1] + want[2], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["flat", "multi"])
def test_kernels_interpreted_match_the_reference_path(form):
    with backend.use_backend("triton"):
        got = _run(form)
    _compare(got, _emulated(truncate=True))


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["flat", "multi"])
def test_kernels_on_a_gpu_match_the_reference_path(form):
    got = _run(form, "cuda")
    _compare([[t.cpu() for t in ts] for ts in got], _emulated())
