"""The folded mixed-precision step: a read-only norm + inf pass, then
FusedAdamW unscales and clips the raw gradients in its own pass.

Parity with the unscaling step (``fold_unscale=False``: unscale into fp32 main gradients, then
step) bit for bit, after several steps, on: the model's parameters, the fp32 masters, every
optimizer state tensor (exp_avg, exp_avg_sq, step), the returned norms and skip flags, the
skipped-step count and the scaler's state — fp16 with a dynamic scaler and a skipped step, bf16
without a scaler, a model mixing fp32 and low-precision parameters, clipping active in all; and
over two ranks, with the inf on one rank only. Also: which optimizers fold by default, that no
fp32 main gradient is allocated and the model's gradients are left as backward made them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastpar.amp import DynamicLossScaler
from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
from fastpar.testing import run_ranks


def _mlp(dtype: torch.dtype, fp32_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 16), nn.LayerNorm(16))
    model = model.to(dtype)
    if fp32_norm:
        model[3].float()  # a mixed model: fp32 LayerNorm, low-precision linears
    return model


def _batch(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model[2](model[1](model[0](x.to(model[0].weight.dtype))))
    return model[3](h.to(model[3].weight.dtype)).float()


def _pair(
    dtype,
    *,
    scaler: bool,
    fp32_norm: bool = False,
    max_grad_norm: float = 0.05,
    device: str = "cpu",
):
    """(model, optimizer) for the unscaling and the folded step, from the same weights."""
    out = []
    base = _mlp(dtype, fp32_norm).to(device)
    for fold in (False, None):
        model = copy.deepcopy(base)
        matrices = [p for p in model.parameters() if p.dim() == 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]  # a second param group
        groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
        inner = FusedAdamW(groups, lr=1e-2, weight_decay=0.1)
        sc = DynamicLossScaler(initial_scale=2.0**12, hysteresis=1, device=device)
        sc = sc if scaler else None
        opt = MixedPrecisionOptimizer(
            inner, scaler=sc, max_grad_norm=max_grad_norm, fold_unscale=fold
        )
        out.append((model, opt))
    assert not out[0][1].fold_unscale and out[1][1].fold_unscale
    return out


def _train(model, opt, steps: int, inf_at: int | None, rank: int = 0, inf_rank: int = 0):
    results = []
    for step in range(steps):
        x, y = (t.to(model[0].weight.device) for t in _batch(step, rank))
        opt.scale_loss(F.mse_loss(_forward(model, x), y)).backward()
        if step == inf_at and rank == inf_rank:
            model[0].weight.grad.view(-1)[-1] = float("inf")
        skipped, norm = opt.step()
        results.append((skipped.clone(), norm.clone()))
        opt.zero_grad()
    return results


def _assert_same(a, b) -> None:
    """Bit for bit, on purpose: both steps run the same fp32 arithmetic in the same order. The
    norm is the sum of squares of the same products fp32(g)·inv_scale, the read-only pass
    taking the writing pass's per-tensor sums in the same order (``fastpar.optim.
    mixed_precision``); AdamW sees the same gradient, fp32(g)·inv_scale then ·clip_coef,
    whether the unscale pass stored the first product or FusedAdamW forms both; the rest is the
    same elementwise update. No reduction runs in another order, so no machine's rounding
    enters (a difference is a defect of the folding, not rounding)."""
    (model_a, opt_a, res_a), (model_b, opt_b, res_b) = a, b
    for (sa, na), (sb, nb) in zip(res_a, res_b, strict=True):
        assert torch.equal(sa, sb)
        assert torch.equal(na, nb) or (torch.isnan(na) and torch.isnan(nb)), (na, nb)
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
    for m, n in zip(opt_a.masters, opt_b.masters, strict=True):
        assert torch.equal(m, n)
    assert len(opt_a.param_groups) == 2
    state_a, state_b = opt_a.optimizer.state, opt_b.optimizer.state
    for m, n in zip(opt_a.masters, opt_b.masters, strict=True):
        assert state_a[m].keys() == state_b[n].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in state_a[m]:
            assert torch.equal(state_a[m][key], state_b[n][key]), key
    assert torch.equal(opt_a.skipped_steps, opt_b.skipped_steps)
    if opt_a.scaler is not None:
        for key, value in opt_a.scaler.state_dict().items():
            assert torch.equal(value, opt_b.scaler.state_dict()[key]), key


@pytest.mark.parametrize("fp32_norm", [False, True], ids=["fp16", "fp16+fp32"])
def test_fp16_with_a_skipped_step_and_clipping_matches_the_unscaling_step(fp32_norm):
    (ma, oa), (mb, ob) = _pair(torch.float16, scaler=True, fp32_norm=fp32_norm)
    a = (ma, oa, _train(ma, oa, 6, inf_at=2))
    b = (mb, ob, _train(mb, ob, 6, inf_at=2))
    _assert_same(a, b)
    skips = [bool(s) for s, _ in b[2]]
    assert skips == [False, False, True, False, False, False]
    assert int(ob.skipped_steps) == 1 and float(ob.scaler.scale) == 2.0**11
    clipped = [float(n) for s, n in b[2] if not s]
    assert all(n > 0.05 for n in clipped)  # clipping was active on every clean step
    assert all(float(s["step"]) == 5 for s in ob.optimizer.state.values())


@pytest.mark.parametrize("fp32_norm", [False, True], ids=["bf16", "bf16+fp32"])
def test_bf16_without_scaler_with_clipping_matches_the_unscaling_step(fp32_norm):
    (ma, oa), (mb, ob) = _pair(torch.bfloat16, scaler=False, fp32_norm=fp32_norm)
    a = (ma, oa, _train(ma, oa, 5, inf_at=None))
    b = (mb, ob, _train(mb, ob, 5, inf_at=None))
    _assert_same(a, b)
    assert all(float(n) > 0.05 and not bool(s) for s, n in b[2])


def test_folded_step_writes_no_fp32_main_gradient_and_leaves_grads_scaled():
    (_, _), (model, opt) = _pair(torch.float16, scaler=True, fp32_norm=True)
    x, y = _batch(0)
    opt.scale_loss(F.mse_loss(_forward(model, x), y)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, m, g in zip(model.parameters(), opt.masters, before, strict=True):
        assert torch.equal(p.grad, g)  # still scaled: nothing was written into the gradients
        if m is not p:
            assert m.grad is None
        else:
            assert m.grad is p.grad


def test_which_optimizers_fold():
    params = list(_mlp(torch.float16).parameters())
    assert MixedPrecisionOptimizer(FusedAdamW(params)).fold_unscale
    assert not MixedPrecisionOptimizer(FusedAdamW(params), fold_unscale=False).fold_unscale
    for inner in (torch.optim.AdamW(params, fused=True), torch.optim.SGD(params, lr=0.1)):
        assert not MixedPrecisionOptimizer(inner).fold_unscale  # torch's: unscaled as before
        with pytest.raises(ValueError, match="fold_unscale=True needs"):
            MixedPrecisionOptimizer(inner, fold_unscale=True)


def _two_ranks() -> list:
    """Each rank its own data; the inf on rank 1 only, at step 1: both paths skip it on both
    ranks and agree bit for bit."""
    rank = dist.get_rank()
    runs = []
    for model, opt in _pair(torch.float16, scaler=True, fp32_norm=True):
        runs.append((model, opt, _train(model, opt, 4, inf_at=1, rank=rank, inf_rank=1)))
    _assert_same(*runs)
    return [bool(s) for s, _ in runs[1][2]]


def test_two_ranks_inf_on_one_rank_matches_the_unscaling_step():
    assert run_ranks(_two_ranks, 2) == [[False, True, False, False]] * 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (GPU tier)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_folded_step_matches_the_unscaling_step(dtype):
    """On a GPU (Triton kernels natively): the same bit-for-bit parity."""
    scaler = dtype == torch.float16
    runs = []
    for model, opt in _pair(dtype, scaler=scaler, fp32_norm=True, device="cuda"):
        runs.append((model, opt, _train(model, opt, 5, inf_at=2 if scaler else None)))
    _assert_same(*runs)
