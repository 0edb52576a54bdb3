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

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _amp_folded import assert_same, batch, forward, mlp, pair, train

from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
from fastpar.testing import run_ranks


@pytest.mark.parametrize("fp32_norm", [False, True], ids=["fp16", "fp16+fp32"])
def test_fp16_with_a_skipped_step_and_clipping_matches_the_unscaling_step(fp32_norm):
    (ma, oa), (mb, ob) = pair(torch.float16, scaler=True, fp32_norm=fp32_norm)
    a = (ma, oa, train(ma, oa, 6, inf_at=2))
    b = (mb, ob, train(mb, ob, 6, inf_at=2))
    assert_same(a, b)
    skips = [bool(s) for s, _ in b[2]]
    assert skips == [False, False, True, False, False, False]
    assert int(ob.skipped_steps) == 1 and float(ob.scaler.scale) == 2.0**11
    clipped = [float(n) for s, n in b[2] if not s]
    assert all(n > 0.05 for n in clipped)  # clipping was active on every clean step
    assert all(float(s["step"]) == 5 for s in ob.optimizer.state.values())


@pytest.mark.parametrize("fp32_norm", [False, True], ids=["bf16", "bf16+fp32"])
def test_bf16_without_scaler_with_clipping_matches_the_unscaling_step(fp32_norm):
    (ma, oa), (mb, ob) = pair(torch.bfloat16, scaler=False, fp32_norm=fp32_norm)
    a = (ma, oa, train(ma, oa, 5, inf_at=None))
    b = (mb, ob, train(mb, ob, 5, inf_at=None))
    assert_same(a, b)
    assert all(float(n) > 0.05 and not bool(s) for s, n in b[2])


def test_folded_step_writes_no_fp32_main_gradient_and_leaves_grads_scaled():
    (_, _), (model, opt) = pair(torch.float16, scaler=True, fp32_norm=True)
    x, y = batch(0)
    opt.scale_loss(F.mse_loss(forward(model, x), y)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, m, g in zip(model.parameters(), opt.masters, before, strict=True):
        assert torch.equal(p.grad, g)  # still scaled: nothing was written into the gradients
        if m is not p:
            assert m.grad is None
        else:
            assert m.grad is p.grad


def test_which_optimizers_fold():
    params = list(mlp(torch.float16).parameters())
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
    for model, opt in pair(torch.float16, scaler=True, fp32_norm=True):
        runs.append((model, opt, train(model, opt, 4, inf_at=1, rank=rank, inf_rank=1)))
    assert_same(*runs)
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
    for model, opt in pair(dtype, scaler=scaler, fp32_norm=True, device="cuda"):
        runs.append((model, opt, train(model, opt, 5, inf_at=2 if scaler else None)))
    assert_same(*runs)
