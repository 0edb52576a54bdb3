"""Fused AdamW, CPU tier: the torch reference path of ``fastpar.ops.adamw`` and ``FusedAdamW``.

The oracle is ``torch.optim.AdamW(foreach=False)`` on fp32 parameters whose gradient is the
fp32 value of the low-precision gradient (pre-multiplied by ``inv_scale`` then ``clip_coef`` when
those are given). The reference follows torch's order of operations and must match it bit for bit
after 10 steps: odd sizes (1 / 123 / 10,007), weight decay 0 and 0.1, maximize, both branches of
torch.lerp (β1 = 0.9 and 0.3), fp32 / bf16 / fp16 gradients with a bf16 / fp16 param copy equal
to ``master.to(dtype)``, int64 and fp32 step tensors, a skip (``found_inf`` 1 or NaN) that writes
nothing, the multi-tensor form with per-tensor steps, FusedAdamW with several param groups, under
``torch.amp.GradScaler("cpu")`` with an injected inf, and a state_dict round trip.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys

import pytest
import torch
from _adamw import torch_adamw

from fastpar.ops import adamw as op
from fastpar.optim.fused_adamw import FusedAdamW

STEPS = 10
HYPER = dict(lr=1e-3, eps=1e-8)


def _grads(numel: int, dtype: torch.dtype, seed: int, scale: float = 1e-2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=gen) * scale).to(dtype) for _ in range(STEPS)]


_torch_adamw = functools.partial(torch_adamw, **HYPER)  # (p, m, v) of torch.optim.AdamW


def _assert_bitwise(got, want) -> None:
    """Bit for bit, on purpose: the reference runs torch.optim.AdamW's own elementwise fp32 ops
    (lerp_, mul_, addcmul_, sqrt, div, add_) in torch's order with the same fp32 scalars, and on
    a CPU FusedAdamW runs the reference; both sides call the same torch kernels and sum nothing,
    so no machine's summation order enters (the Triton kernels are judged against float64)."""
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), f"{int((g != w).sum())} of {g.numel()} elements differ"


@pytest.mark.parametrize("numel", [1, 123, 10_007])
@pytest.mark.parametrize(
    ("grad_dtype", "lp_dtype"),
    [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    ids=["fp32", "bf16", "fp16"],
)
@pytest.mark.parametrize(
    ("beta1", "weight_decay", "maximize"),
    [(0.9, 0.1, False), (0.9, 0.0, True), (0.3, 0.1, False)],
    ids=["wd0.1", "wd0-maximize", "beta1_0.3"],
)
def test_flat_matches_torch_adamw(numel, grad_dtype, lp_dtype, beta1, weight_decay, maximize):
    p0 = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    grads = _grads(numel, grad_dtype, seed=numel + 1)
    p, m, v = p0.clone(), torch.zeros(numel), torch.zeros(numel)
    lp = None if lp_dtype is None else torch.empty(numel, dtype=lp_dtype)
    step = torch.zeros((), dtype=torch.int64)
    for g in grads:
        step += 1
        op.adamw_step_(
            p,
            g,
            m,
            v,
            beta1=beta1,
            beta2=0.999,
            weight_decay=weight_decay,
            step=step,
            param_lp=lp,
            maximize=maximize,
            **HYPER,
        )
    want = _torch_adamw(p0, grads, beta1=beta1, weight_decay=weight_decay, maximize=maximize)
    _assert_bitwise((p, m, v), want)
    if lp is not None:
        assert torch.equal(lp, p.to(lp_dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inv_scale_and_clip_coef(grad_dtype):
    """g · inv_scale · clip_coef in the kernel == torch AdamW on grads pre-multiplied in fp32."""
    numel, loss_scale = 1_003, 2.0**12
    p0 = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    grads = _grads(numel, grad_dtype, seed=4, scale=1e-2 * loss_scale)
    inv = torch.tensor(1.0 / loss_scale)
    clip = torch.tensor(0.3711)  # not a power of two: the product order matters
    p, m, v = p0.clone(), torch.zeros(numel), torch.zeros(numel)
    step = torch.zeros(())
    for g in grads:
        step += 1
        op.adamw_step_(
            p,
            g,
            m,
            v,
            beta1=0.9,
            beta2=0.95,
            weight_decay=0.1,
            step=step,
            inv_scale=inv,
            clip_coef=clip,
            **HYPER,
        )
    want = _torch_adamw(
        p0, grads, beta1=0.9, beta2=0.95, weight_decay=0.1, pre=lambda g: g * inv * clip
    )
    _assert_bitwise((p, m, v), want)


@pytest.mark.parametrize("flag", [1.0, float("nan")], ids=["one", "nan"])
def test_found_inf_skips_everything(flag):
    numel = 123
    gen = torch.Generator().manual_seed(5)
    p, m, v = torch.randn(numel, generator=gen), torch.rand(numel), torch.rand(numel)
    lp = torch.randn(numel, generator=gen).half()
    grads = torch.full((numel,), float("inf"))
    before = [t.clone() for t in (p, m, v, lp)]
    step = torch.tensor(7, dtype=torch.int64)
    found_inf = torch.tensor(flag)
    step += (found_inf == 0).long()  # the caller's convention: no advance on a skipped step
    op.adamw_step_(
        p,
        grads,
        m,
        v,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.1,
        step=step,
        found_inf=found_inf,
        param_lp=lp,
        **HYPER,
    )
    _assert_bitwise((p, m, v, lp), before)
    assert int(step) == 7


def test_non_contiguous_tensors_are_updated_in_place():
    """A transposed param and moments with a flat gradient (the reference path on every
    backend): updated in place, like torch AdamW on contiguous copies."""
    gen = torch.Generator().manual_seed(8)
    p0 = torch.randn(13, 7, generator=gen)
    grads = _grads(91, torch.float32, seed=9)
    p = p0.t().contiguous().t()  # same values, column-major
    m, v = torch.zeros(7, 13).t(), torch.zeros(7, 13).t()
    lp = torch.empty(7, 13, dtype=torch.float16).t()
    step = torch.zeros(())
    for g in grads:
        step += 1
        op.adamw_step_(
            p,
            g,
            m,
            v,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.1,
            step=step,
            param_lp=lp,
            **HYPER,
        )
    want = _torch_adamw(p0.reshape(-1), grads, beta1=0.9, weight_decay=0.1)
    _assert_bitwise((p.reshape(-1), m.reshape(-1), v.reshape(-1)), want)
    assert not p.is_contiguous() and torch.equal(lp, p.half())


def test_multi_tensor_matches_torch_adamw():
    """Mixed grad dtypes, some copies, an empty tensor, per-tensor steps (one behind)."""
    sizes, dtypes = (
        [1, 0, 123, 1_000, 77],
        [torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float32],
    )
    gen = torch.Generator().manual_seed(6)
    p0 = [torch.randn(n, generator=gen) for n in sizes]
    grads = [
        _grads(n, dt, seed=10 + i) for i, (n, dt) in enumerate(zip(sizes, dtypes, strict=True))
    ]
    ps = [p.clone() for p in p0]
    ms, vs = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    lps = [None, None, torch.empty(123, dtype=torch.bfloat16), torch.empty(1000).half(), None]
    steps = [torch.zeros(()) for _ in sizes]
    for k in range(STEPS):
        active = [i for i in range(len(sizes)) if not (i == 4 and k == 0)]  # tensor 4 starts late
        for i in active:
            steps[i] += 1
        op.adamw_step_multi_(
            [ps[i] for i in active],
            [grads[i][k] for i in active],
            [ms[i] for i in active],
            [vs[i] for i in active],
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.1,
            steps=[steps[i] for i in active],
            params_lp=[lps[i] for i in active],
            **HYPER,
        )
    for i in range(len(sizes)):
        gs = grads[i][1:] if i == 4 else grads[i]
        want = _torch_adamw(p0[i], gs, beta1=0.9, weight_decay=0.1)
        _assert_bitwise((ps[i], ms[i], vs[i]), want)
        if lps[i] is not None:
            assert torch.equal(lps[i], ps[i].to(lps[i].dtype))
    assert [int(s) for s in steps] == [10, 10, 10, 10, 9]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.Linear(5, 1)
    )


def _groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": list(model[0].parameters())},  # the defaults
        {"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.0},
        {"params": list(model[3].parameters()), "betas": (0.5, 0.9), "maximize": True},
    ]


def _train(model, opt, steps, scaler=None, inf_at=(), seed=1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for k in range(steps):
        x = torch.randn(9, 7, generator=gen)
        loss = model(x).square().mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if k in inf_at:
            model[0].weight.grad[1, 2] = float("inf")
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()


def _torch_opt(model):
    return torch.optim.AdamW(_groups(model), lr=1e-2, weight_decay=0.05, foreach=False)


def test_fused_adamw_matches_torch_adamw():
    ours, theirs = _model(), _model()
    opt = FusedAdamW(_groups(ours), lr=1e-2, weight_decay=0.05)
    _train(ours, opt, STEPS)
    _train(theirs, _torch_opt(theirs), STEPS)
    _assert_bitwise(list(ours.parameters()), list(theirs.parameters()))
    assert all(
        isinstance(s["step"], torch.Tensor) and int(s["step"]) == STEPS for s in opt.state.values()
    )


def test_fused_adamw_under_grad_scaler():
    """torch.amp.GradScaler("cpu") passes grad_scale / found_inf; the inf steps are skipped on
    the device and do not advance the step counts."""
    ours, theirs = _model(), _model()
    opt = FusedAdamW(_groups(ours), lr=1e-2, weight_decay=0.05)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    _train(ours, opt, STEPS, scaler=scalers[0], inf_at=(2, 3))
    _train(theirs, _torch_opt(theirs), STEPS, scaler=scalers[1], inf_at=(2, 3))
    _assert_bitwise(list(ours.parameters()), list(theirs.parameters()))
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**8
    assert {int(s["step"]) for s in opt.state.values()} == {STEPS - 2}


def test_fused_adamw_clip_coef_attribute():
    ours, theirs = _model(), _model()
    opt = FusedAdamW(ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    coef = torch.tensor(0.25)
    opt.clip_coef = coef
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(2))
    for model, o in ((ours, opt), (theirs, ref)):
        model(x).sum().backward()
        if o is ref:
            torch._foreach_mul_([p.grad for p in theirs.parameters()], coef)
        o.step()
    _assert_bitwise(list(ours.parameters()), list(theirs.parameters()))


def test_state_dict_round_trip_resumes_bit_identically():
    model = _model()
    opt = FusedAdamW(_groups(model), lr=1e-2, weight_decay=0.05)
    _train(model, opt, 5)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, 5, seed=2)

    resumed = _model(seed=123)
    resumed.load_state_dict(saved_model)
    opt2 = FusedAdamW(_groups(resumed), lr=1.0, weight_decay=0.0)  # groups come from the dict
    opt2.load_state_dict(saved_opt)
    _train(resumed, opt2, 5, seed=2)
    _assert_bitwise(list(resumed.parameters()), list(model.parameters()))
    for p in resumed.parameters():
        st = opt2.state[p]
        assert st["step"].dtype == torch.float32 and int(st["step"]) == 10


def test_validation_errors_name_the_problem():
    p, m, v = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    step = torch.ones(())
    kw = dict(beta1=0.9, beta2=0.999, weight_decay=0.0, step=step, eps=1e-8)
    with pytest.raises(TypeError, match=r"exp_avg is torch\.bfloat16"):
        op.adamw_step_(p, p, m.bfloat16(), v, lr=1e-3, **kw)
    with pytest.raises(ValueError, match="grad has 3 elements"):
        op.adamw_step_(p, torch.zeros(3), m, v, lr=1e-3, **kw)
    with pytest.raises(TypeError, match="lr must be a python float"):
        op.adamw_step_(p, p, m, v, lr=torch.tensor(1e-3), **kw)
    with pytest.raises(ValueError, match="inv_scale must be a one-element tensor"):
        op.adamw_step_(p, p, m, v, lr=1e-3, inv_scale=torch.ones(2), **kw)
    with pytest.raises(TypeError, match="fp32 parameters"):
        q = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        q.grad = torch.zeros_like(q)
        FusedAdamW([q]).step()


def test_import_does_not_load_triton():
    code = (
        "import sys, fastpar.ops.adamw, fastpar.optim.fused_adamw, torch\n"
        "p = torch.zeros(3); fastpar.ops.adamw.adamw_step_(p, p.clone(), p.clone(), p.clone(),"
        " lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=torch.ones(()))\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("flag", [1.0, 0.0], ids=["skip", "step"])
def test_reference_device_flag_path(monkeypatch, flag):
    """The reference's no-sync path (a flag on an accelerator, e.g. non-contiguous CUDA tensors):
    forced on a CPU, it keeps everything on a skip and equals the plain update otherwise."""
    from fastpar.reference import adamw as ref

    gen = torch.Generator().manual_seed(11)
    p, m, v = torch.randn(50, generator=gen), torch.rand(50), torch.rand(50)
    g, lp = torch.randn(50, generator=gen), torch.empty(50, dtype=torch.float16)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=torch.ones(()))
    plain = [t.clone() for t in (p, m, v)]
    ref.adamw_step_(*plain[:1], g, *plain[1:], **kw)
    before = [t.clone() for t in (p, m, v)]
    monkeypatch.setattr(ref, "_skip_on_host", lambda f: None if f is not None else False)
    ref.adamw_step_(p, g, m, v, found_inf=torch.tensor(flag), param_lp=lp, **kw)
    _assert_bitwise((p, m, v), before if flag else plain)
    if not flag:
        assert torch.equal(lp, p.half())
