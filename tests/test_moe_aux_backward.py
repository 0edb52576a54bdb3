"""The MoE auxiliary loss reaches backward the same way in every path: a layer used in a plain
loop (no ``fastpar.train``, no pipeline engine) trains its router on the aux loss by itself,
with weight 1 unless told otherwise, and never twice. References: the same layer with
``aux_loss_in_backward=False`` and the aux loss added to the loss by hand (the old API).

The aux loss sent into backward by the layer and added to the loss by hand are the same math
in another graph (the router's gradient from the two paths is accumulated in another order),
so those are judged by ``fastpar.tolerance``'s rule (docs/tolerances.md): the error against the
by-hand reference in float64 at most 4 x the fp32 reference's own plus a floor. Where both
sides run the same graph (a detached value added to the loss, or no aux loss in backward at
all) the gradients are equal bit for bit."""

from __future__ import annotations

import pytest
import torch
from _parity import agree, exact_copy

from fastpar.moe import MoE, moe_aux_loss
from fastpar.moe.layer import aux_loss_scale

H, F, E = 8, 16, 4


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(H, F, E, top_k=2, capacity_factor=None, aux_loss_coef=0.5, z_loss_coef=0.1, **kw)


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, H, generator=g)
    x[0] += 1.0  # uneven load: a non-trivial aux gradient
    return x, torch.randn(2, 5, H, generator=g)


def _grads(moe: MoE, loss_of) -> dict[str, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    x, g = (t.to(moe.w1.dtype) for t in _data())
    x.requires_grad_()
    y = moe(x)
    loss_of(moe, y, g).backward()
    out = {n: p.grad.clone() for n, p in moe.named_parameters()}
    out["x"] = x.grad.clone()
    return out


def _task(moe, y, g):
    return (y * g).sum()


def _by_hand(weight: float):
    return lambda moe, y, g: (y * g).sum() + weight * moe_aux_loss(moe)


def _assert_agree(got: dict, loss_of) -> None:
    """``got`` (gradients) against the reference layer (``aux_loss_in_backward=False``) under
    ``loss_of`` by the rule: the reference in fp32 and its float64 copy."""
    ref = _moe(aux_loss_in_backward=False)
    ref64 = exact_copy(ref)
    want, exact = _grads(ref, loss_of), _grads(ref64, loss_of)
    assert got.keys() == want.keys()
    for k in got:
        agree(got[k], want[k], exact[k], k, length=F)


def _assert_same(a: dict, b: dict) -> None:
    """The same graph on both sides: bit for bit."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_default_sends_the_aux_loss_to_backward_with_weight_one():
    got = _grads(_moe(), _task)
    _assert_agree(got, _by_hand(1.0))
    without = _grads(_moe(aux_loss_in_backward=False), _task)
    diff = (got["router.weight"] - without["router.weight"]).abs().max()
    assert diff > 1e-3, "the aux loss must change the router's gradient in this case"


def test_adding_moe_aux_loss_by_hand_as_before_does_not_count_it_twice():
    moe = _moe()
    got = _grads(moe, _by_hand(1.0))
    assert not moe.aux_loss.requires_grad and not moe_aux_loss(moe).requires_grad
    assert float(moe.aux_loss) > 0
    _assert_same(got, _grads(_moe(), _task))  # adding a detached value changes no gradient


def test_layer_attribute_sets_the_weight():
    moe = _moe()
    moe.aux_loss_scale = 0.25
    _assert_agree(_grads(moe, _task), _by_hand(0.25))


def test_context_sets_the_weight_and_none_turns_it_off():
    moe, ref = _moe(), _moe(aux_loss_in_backward=False)
    with aux_loss_scale(3.0):
        got = _grads(moe, _task)
    _assert_agree(got, _by_hand(3.0))
    with aux_loss_scale(None):
        off = _grads(_moe(), _task)
    _assert_same(off, _grads(ref, _task))  # no aux loss in backward on either side
    # a layer that opted out still follows an engine's context (the engine owns the weighting)
    with aux_loss_scale(2.0):
        got = _grads(_moe(aux_loss_in_backward=False), _task)
    _assert_agree(got, _by_hand(2.0))


def test_opted_out_layer_leaves_a_differentiable_aux_loss():
    moe = _moe(aux_loss_in_backward=False)
    moe(_data()[0])
    assert moe.aux_loss.requires_grad and moe_aux_loss(moe).requires_grad


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_no_injection_outside_training(mode):
    moe = _moe()
    x = _data()[0]
    if mode == "eval":
        moe.eval()
        y = moe(x.requires_grad_())
        assert moe.aux_loss.requires_grad  # left for the caller, not sent anywhere
        y.sum().backward()  # no aux gradient: equals the opted-out layer's
        ref = _moe(aux_loss_in_backward=False).eval()
        ref(x).sum().backward()
        # the same graph (no aux loss in backward on either side): bit for bit
        assert torch.equal(moe.router.weight.grad, ref.router.weight.grad)
    else:
        with torch.no_grad():
            moe(x)
        assert not moe.aux_loss.requires_grad
