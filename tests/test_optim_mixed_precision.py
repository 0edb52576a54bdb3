"""MixedPrecisionOptimizer: fp16 tracks the exact math, overflow skips agree on every rank,
clipping and state_dict behave like the single-process torch path.

Training in fp16, or a norm summed per TP shard, rounds otherwise than the single process: such
results are judged by ``fastpar.tolerance``'s rule against the same training in float64 (the
steps the run skipped skipped there too), with a single-process run in the same precision (and
its twin, from weights one ulp away) as the measure of rounding. Bit for bit where nothing is
computed differently: a skipped step (nothing written), the masters' copy in the model, a
state_dict round trip (the same ops on the same values)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _parity import exact_copy, local_slice
from torch import nn

from fastpar.amp import DynamicLossScaler
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, param_layout
from fastpar.optim import MixedPrecisionOptimizer
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree, nudge


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


STEPS_FP16 = 30


def _inner(params, adamw: bool, **adamw_kw) -> torch.optim.Optimizer:
    """AdamW (lr 1e-2, ``adamw_kw``: fused=True, foreach=False) or SGD (lr 0.05)."""
    if adamw:
        return torch.optim.AdamW(params, lr=1e-2, **adamw_kw)
    return torch.optim.SGD(params, lr=0.05)


def _scaler() -> DynamicLossScaler:
    return DynamicLossScaler(initial_scale=2.0**20, growth_interval=5)


def _fp16_by_hand(half: nn.Module, adamw: bool, x, y) -> tuple[list[float], list[bool]]:
    """The same fp16 training written out with torch alone: the fp16 model, fp32 masters that
    torch's optimizer steps, the loss scaled by a scaler of the same settings, a step skipped
    when a gradient is not finite. Returns (losses, skipped per step)."""
    params = list(half.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = _inner(masters, adamw, foreach=False)
    scaler = _scaler()
    losses, skips = [], []
    for _ in range(STEPS_FP16):
        half.zero_grad(set_to_none=True)
        loss = F.mse_loss(half(x.half()).float(), y)
        (loss * scaler.scale).backward()
        found = not all(bool(torch.isfinite(p.grad).all()) for p in params)
        if not found:
            for m, p in zip(masters, params, strict=True):
                m.grad = p.grad.float() / scaler.scale
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, params, strict=True):
                    p.copy_(m)
        scaler.update(found)
        losses.append(loss.item())
        skips.append(found)
    return losses, skips


def _float64_run(half: nn.Module, adamw: bool, x, y, skips: list[bool]) -> list[float]:
    """The same training in float64 from the same (fp16) weights and inputs, skipping the steps
    the fp16 run skipped (its decision, not rounding's; docs/tolerances.md)."""
    model = exact_copy(half)
    opt = _inner(model.parameters(), adamw, foreach=False)
    losses = []
    for skip in skips:
        opt.zero_grad()
        loss = F.mse_loss(model(x.half().double()), y.double())
        loss.backward()
        if not skip:
            opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_tracks_the_exact_math_and_never_writes_nan(fused):
    """fp16 training with fp32 masters (AdamW fused, or SGD): the loss of every step against
    the same training in float64, with an fp16 run written out with torch alone (and its twin)
    as the measure of fp16 rounding; both take the same skips."""
    torch.manual_seed(0)
    half = _mlp().half()
    start = copy.deepcopy(half)
    opt = MixedPrecisionOptimizer(_inner(half.parameters(), fused, fused=True), scaler=_scaler())
    losses_half, skips = [], []
    x, y = _batch(0)  # one fixed batch: the model must fit it
    for step in range(STEPS_FP16):
        loss_h = F.mse_loss(half(x.half()).float(), y)
        opt.zero_grad()
        opt.scale_loss(loss_h).backward()
        skipped, norm = opt.step()
        assert skipped.dtype == torch.bool and norm.dim() == 0
        losses_half.append(loss_h.item())
        skips.append(bool(skipped))
        for p in half.parameters():
            assert torch.isfinite(p).all(), f"non-finite weight at step {step}"
    # the initial 2^20 scale overflows fp16 at first: those steps are skipped, then training runs
    assert int(opt.skipped_steps) >= 1
    assert losses_half[-1] < losses_half[0] * 0.7
    twin = copy.deepcopy(start)
    nudge(twin, seed=1)
    single = [_fp16_by_hand(copy.deepcopy(m), fused, x, y) for m in (start, twin)]
    exact = _float64_run(start, fused, x, y, skips)
    length = max(x.numel(), 32)  # the loss sums 8 x 16 values; the widest layer is 32
    for step in range(STEPS_FP16):  # a step's loss depends on the earlier steps' skips only
        assert_agree(
            losses_half[step],
            [r[0][step] for r in single],
            exact[step],
            length=length,
            dtype=torch.float16,
            what=f"fp16 loss of step {step + 1}",
        )
        for name, (_, theirs) in zip(("the torch-only fp16 run", "its twin"), single, strict=True):
            assert theirs[step] == skips[step], (
                f"step {step + 1}: {name} skipped {theirs[step]}, the optimizer {skips[step]}"
            )


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
        assert torch.equal(p, m.bfloat16())  # bit for bit: the model holds its masters' rounding


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
    mesh = make_mesh(tp=tp, pp=pp)
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
    """fp32, TP=tp: the optimizer's clipping equals clip_grad_norm_ + step on the dense model
    (fp32, its twin and float64: the rule's references)."""
    torch.manual_seed(3)
    dense = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12))
    par = nn.Sequential(
        ColumnParallelLinear.from_dense(dense[0]), nn.GELU(), RowParallelLinear.from_dense(dense[2])
    )
    twin, exact = exact_copy(dense).float(), exact_copy(dense)
    nudge(twin, seed=1)
    refs = (dense, twin, exact)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in refs]
    opt_p = MixedPrecisionOptimizer(torch.optim.SGD(par.parameters(), lr=0.1), max_grad_norm=0.05)
    # the norm sums the squares of a [24, 12] gradient; the losses 6 x 12 values
    length = 24 * 12
    rank = dist.get_rank()
    for step in range(3):
        x, y = torch.randn(6, 12, generator=torch.Generator().manual_seed(step)), torch.zeros(6, 12)
        for m in (*refs, par):
            m.zero_grad()
            dtype = next(m.parameters()).dtype
            F.mse_loss(m(x.to(dtype)), y.to(dtype)).backward()
        want = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05) for m in refs]
        for o in opts:
            o.step()
        skipped, norm = opt_p.step()
        assert not skipped
        assert_agree(
            norm, want[:2], want[2], length=length, what=f"norm at step {step} on rank {rank}"
        )
    named = [dict(m.named_parameters()) for m in refs]
    for name, p in par.named_parameters():
        expect = [
            r[name].detach() if param_layout(p) is None else local_slice(r[name].detach(), p)
            for r in named
        ]
        assert_agree(
            p.detach(),
            expect[:2],
            expect[2],
            length=length,
            what=f"{name} after clipped steps on rank {rank}",
        )


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
        assert torch.equal(a, b)  # bit for bit: a round trip copies
    assert opt2.scaler.scale.item() == opt.scaler.scale.item()
    x, y = _batch(9)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        o.scale_loss(F.mse_loss(m(x.half()).float(), y)).backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)  # bit for bit: the same step's ops on the same values


def test_bad_use():
    model = _mlp()
    inner = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    inner.step()
    with pytest.raises(ValueError, match="wrap the optimizer before its first step"):
        MixedPrecisionOptimizer(inner)
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        MixedPrecisionOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), max_grad_norm=0.0)
