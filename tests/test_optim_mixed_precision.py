"""MixedPrecisionOptimizer: fp16 tracks fp32, overflow skips agree on every rank, clipping and
state_dict behave like the single-process torch path."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import assert_close, local_slice
from torch import nn

from fastpar import ParallelMesh
from fastpar.amp import DynamicLossScaler
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, param_layout
from fastpar.optim import MixedPrecisionOptimizer
from fastpar.testing import run_ranks


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_tracks_fp32_and_never_writes_nan(fused):
    torch.manual_seed(0)
    ref = _mlp()
    half = copy.deepcopy(ref).half()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    inner = (
        torch.optim.AdamW(half.parameters(), lr=1e-2, fused=fused)
        if fused
        else torch.optim.SGD(half.parameters(), lr=0.05)
    )
    if not fused:
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = MixedPrecisionOptimizer(
        inner, scaler=DynamicLossScaler(initial_scale=2.0**20, growth_interval=5)
    )
    losses_ref, losses_half = [], []
    x, y = _batch(0)  # one fixed batch: both models must fit it
    for step in range(30):
        loss = F.mse_loss(ref(x), y)
        opt_ref.zero_grad()
        loss.backward()
        opt_ref.step()
        losses_ref.append(loss.item())
        loss_h = F.mse_loss(half(x.half()).float(), y)
        opt.zero_grad()
        opt.scale_loss(loss_h).backward()
        skipped, norm = opt.step()
        assert skipped.dtype == torch.bool and norm.dim() == 0
        losses_half.append(loss_h.item())
        for p in half.parameters():
            assert torch.isfinite(p).all(), f"non-finite weight at step {step}"
    # the initial 2^20 scale overflows fp16 at first: those steps are skipped, then training runs
    assert int(opt.skipped_steps) >= 1
    assert losses_half[-1] < losses_half[0] * 0.7
    assert abs(losses_half[-1] - losses_ref[-1]) < 0.05 * losses_ref[0]


def test_bf16_without_scaler_and_masters_are_fp32():
    torch.manual_seed(0)
    model = _mlp().bfloat16()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    assert all(m.dtype == torch.float32 for m in opt.masters)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x, y = _batch(0)
    first = None
    for _ in range(10):
        loss = F.mse_loss(model(x.bfloat16()).float(), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        opt.scale_loss(loss).backward()
        skipped, _ = opt.step()
        assert not skipped
    assert loss.item() < first
    for p, m in zip(model.parameters(), opt.masters, strict=True):
        assert torch.equal(p, m.bfloat16())


@pytest.mark.parametrize("fused", [True, False])
def test_inf_step_is_skipped_and_scale_backs_off(fused):
    torch.manual_seed(0)
    model = _mlp().half()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    opt = MixedPrecisionOptimizer(
        inner, scaler=DynamicLossScaler(initial_scale=1024.0, hysteresis=1)
    )
    x, y = _batch(0)
    opt.scale_loss(F.mse_loss(model(x.half()).float(), y)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = [m.detach().clone() for m in opt.masters]
    model[0].weight.grad[0, 0] = float("nan")
    skipped, _ = opt.step()
    assert bool(skipped) and int(opt.skipped_steps) == 1
    assert opt.scaler.scale.item() == 512.0
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(masters_before, opt.masters, strict=True):
        assert torch.equal(a, b)
    assert not inner.state or all(int(s["step"]) == 0 for s in inner.state.values())


def _tp_dp_skip(tp: int, pp: int) -> tuple:
    mesh = ParallelMesh(tp=tp, pp=pp)
    torch.manual_seed(0)
    fc = ColumnParallelLinear(16, 32, mesh=mesh).half()
    proj = RowParallelLinear(32, 16, mesh=mesh).half()
    params = [*fc.parameters(), *proj.parameters()]
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-2, fused=True),
        scaler=DynamicLossScaler(initial_scale=256.0, hysteresis=1),
        mesh=mesh,
    )
    x, y = _batch(mesh.dp_rank)
    opt.scale_loss(F.mse_loss(proj(F.gelu(fc(x.half()))).float(), y)).backward()
    if dist.get_rank() == dist.get_world_size() - 1:  # one rank only sees an inf
        proj.weight.grad.view(-1)[-1] = float("inf")
    before = [p.detach().clone() for p in params]
    # the inf sits on a DP replica whose copy the norm does not count, but found_inf sees it
    skipped, _ = opt.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    # a clean step afterwards does change the weights
    opt.zero_grad()
    opt.scale_loss(F.mse_loss(proj(F.gelu(fc(x.half()))).float(), y)).backward()
    skipped2, _ = opt.step()
    changed = not all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    return bool(skipped), unchanged, opt.scaler.scale.item(), bool(skipped2), changed


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_inf_on_one_rank_makes_every_rank_skip(tp, pp):
    out = run_ranks(_tp_dp_skip, 4, tp, pp)
    assert out == [(True, True, 128.0, False, True)] * 4


def _clip_parity(tp: int) -> None:
    """fp32, TP=tp: the optimizer's clipping equals clip_grad_norm_ + step on the dense model."""
    torch.manual_seed(3)
    dense = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12))
    par = nn.Sequential(
        ColumnParallelLinear.from_dense(dense[0]), nn.GELU(), RowParallelLinear.from_dense(dense[2])
    )
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.1)
    opt_p = MixedPrecisionOptimizer(torch.optim.SGD(par.parameters(), lr=0.1), max_grad_norm=0.05)
    for step in range(3):
        x, y = torch.randn(6, 12, generator=torch.Generator().manual_seed(step)), torch.zeros(6, 12)
        for m in (dense, par):
            m.zero_grad()
            F.mse_loss(m(x), y).backward()
        want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)
        opt_d.step()
        skipped, norm = opt_p.step()
        assert not skipped
        assert_close(norm, want, f"norm at step {step}")
    for (name, p), (_, q) in zip(par.named_parameters(), dense.named_parameters(), strict=True):
        expect = q if param_layout(p) is None else local_slice(q.detach(), p)
        assert_close(p.detach(), expect.detach(), f"{name} after clipped steps")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_clipping_matches_torch_on_dense_model(tp):
    run_ranks(_clip_parity, tp, tp)


def test_state_dict_round_trip():
    torch.manual_seed(0)
    model = _mlp().half()
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        scaler=DynamicLossScaler(initial_scale=128.0),
    )
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        opt.scale_loss(F.mse_loss(model(x.half()).float(), y)).backward()
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    torch.manual_seed(1)
    model2 = _mlp().half()
    opt2 = MixedPrecisionOptimizer(
        torch.optim.AdamW(model2.parameters(), lr=1e-2), scaler=DynamicLossScaler()
    )
    opt2.load_state_dict(state)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.scaler.scale.item() == opt.scaler.scale.item()
    x, y = _batch(9)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        o.scale_loss(F.mse_loss(m(x.half()).float(), y)).backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_use():
    model = _mlp()
    inner = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    inner.step()
    with pytest.raises(ValueError, match="wrap the optimizer before its first step"):
        MixedPrecisionOptimizer(inner)
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        MixedPrecisionOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), max_grad_norm=0.0)
