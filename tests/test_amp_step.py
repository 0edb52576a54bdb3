"""guarded_step: skips and clips through the optimizer's declared protocol and leaves nothing on
it (a stale ``found_inf`` or ``clip_coef`` would silently skip or scale every later plain step).

FusedAdamW against torch's AdamW is bit for bit here, on purpose: on a CPU FusedAdamW runs its
reference (``fastpar.reference.adamw``), torch's own elementwise ops on the same tensors in the
order of ``torch.optim.AdamW(foreach=False)`` — the same kernels in the same order, not another
implementation — and a stale attribute would show as a different step, not as rounding."""

from __future__ import annotations

import pytest
import torch

from fastpar.amp import AmpOptimizer, FusedAmpStep
from fastpar.amp.step import amp_attributes, guarded_step
from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer

AMP_ATTRIBUTES = {"found_inf", "grad_scale", "clip_coef"}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


OPTIMIZERS = {
    "FusedAdamW": lambda ps: FusedAdamW(ps, lr=0.1),
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "torch SGD": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_guarded_step_leaves_no_attribute_and_skips_on_found(name, found):
    params = _params()
    opt = OPTIMIZERS[name](params)
    before = set(vars(opt))
    start = [p.detach().clone() for p in params]
    norm = torch.tensor(4.0)
    skipped = guarded_step(
        opt, [p.grad for p in params], torch.tensor(found), norm, max_grad_norm=1.0
    )
    assert set(vars(opt)) == before
    assert not AMP_ATTRIBUTES & set(vars(opt))
    assert bool(skipped) == bool(found)
    moved = [not torch.equal(p.detach(), s) for p, s in zip(params, start, strict=True)]
    assert moved == [not found] * len(params)


def test_a_plain_step_after_a_skipped_guarded_step_is_a_full_step():
    """FusedAdamW stepped by guarded_step (found_inf=1, clipping to 1e-3), then plainly: the
    plain step equals torch's AdamW's first step on the unclipped gradients."""
    params = _params()
    opt = FusedAdamW(params, lr=0.1, weight_decay=0.01)
    guarded_step(
        opt, [p.grad for p in params], torch.tensor(1.0), torch.tensor(5.0), max_grad_norm=1e-3
    )
    opt.step()
    ref = _params()
    torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01, foreach=False).step()
    for p, r in zip(params, ref, strict=True):  # bit for bit: the same ops (module docstring)
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)


def test_attributes_set_before_are_put_back_even_when_the_step_raises():
    class Failing(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            assert self.found_inf is not None and self.grad_scale is None  # set for the step
            raise RuntimeError("step failed")

    params = _params()
    opt = Failing(params, lr=0.1)
    mine = torch.tensor(7.0)
    opt.found_inf = mine
    with pytest.raises(RuntimeError, match="step failed"):
        guarded_step(opt, [p.grad for p in params], torch.tensor(0.0), torch.tensor(1.0))
    assert opt.found_inf is mine and "grad_scale" not in vars(opt)
    with amp_attributes(opt, clip_coef=1):
        assert opt.clip_coef == 1
    assert "clip_coef" not in vars(opt)


def test_amp_step_takes_its_scalars_as_arguments():
    """amp_step(found_inf=0, inv_scale, clip_coef): torch's AdamW on grad * inv_scale * clip,
    bit for bit (the reference multiplies the two scalars in the same order, then torch's
    AdamW ops; module docstring)."""
    params = _params()
    opt = FusedAdamW(params, lr=0.1)
    opt.found_inf = torch.tensor(1.0)  # an attribute: amp_step must not read it
    inv, coef = torch.tensor(0.25), torch.tensor(0.5)
    opt.amp_step(found_inf=torch.tensor(0.0), inv_scale=inv, clip_coef=coef)
    ref = _params()
    for r in ref:
        r.grad = r.grad * inv * coef
    torch.optim.AdamW(ref, lr=0.1, foreach=False).step()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)
    start = [p.detach().clone() for p in params]
    opt.amp_step(found_inf=torch.tensor(1.0))
    assert all(torch.equal(p.detach(), s) for p, s in zip(params, start, strict=True))


def test_who_declares_what():
    params = _params()
    assert isinstance(FusedAdamW(params), FusedAmpStep)
    assert not isinstance(torch.optim.AdamW(params, fused=True), FusedAmpStep)
    wrapped = MixedPrecisionOptimizer(torch.optim.SGD(params, lr=0.1))
    assert isinstance(wrapped, AmpOptimizer)
    assert not isinstance(torch.optim.SGD(params, lr=0.1), AmpOptimizer)


def test_folded_guarded_step_hands_inv_scale_and_raw_grads_to_the_optimizer():
    """guarded_step(inv_scale=, grads_for=) on FusedAdamW equals unscaling first: a bf16
    gradient read through ``grads_for`` and unscaled in the optimizer's pass. Bit for bit: the
    same kernel both ways, and a power-of-two ``inv_scale`` multiplies exactly wherever it is
    applied."""
    torch.manual_seed(1)
    raw = [torch.randn(5, 3).bfloat16(), torch.randn(7).bfloat16()]
    inv, norm = torch.tensor(2.0**-4), torch.tensor(4.0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [p.detach().clone().requires_grad_() for p in a]
    for p, g in zip(a, raw, strict=True):
        p.grad = g.float() * inv
    opt_a, opt_b = FusedAdamW(a, lr=0.1), FusedAdamW(b, lr=0.1)
    guarded_step(opt_a, [p.grad for p in a], torch.tensor(0.0), norm, max_grad_norm=1.0)
    guarded_step(
        opt_b,
        [],
        torch.tensor(0.0),
        norm,
        max_grad_norm=1.0,
        inv_scale=inv,
        grads_for=dict(zip(b, raw, strict=True)),
    )
    for p, q in zip(a, b, strict=True):
        assert q.grad is None and torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])
    sgd = torch.optim.SGD(b, lr=0.1)
    with pytest.raises(TypeError, match="does not unscale in its own step"):
        guarded_step(sgd, [], torch.tensor(0.0), norm, inv_scale=inv)
    with pytest.raises(TypeError, match="does not unscale in its own step"):
        guarded_step(sgd, [], torch.tensor(0.0), norm, grads_for={})
