"""``fastpar.optim.Muon`` inside the data-parallel family: ``Replicate`` (stage 0) and ``Shard``
(ZeRO 1, 2, 3) hand the optimizer flat 1-D shards that cut across matrices; Muon gathers each
whole parameter to one owner rank and scatters the result back. With the same batch on both
ranks the DP average is the single-device gradient ((g + g) / 2); three steps agree with three
single-device Muon steps by ``fastpar.tolerance``'s rule (float64 the exact run, fp32 and its
twin the single-process ones: the flat buffers put elements in other SIMD lanes, so not bit for
bit), every parameter; removing the gather (each owner orthogonalising the part of the matrix in
its own shard) is caught."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastpar import tolerance
from fastpar.optim import Muon, muon_param_groups
from fastpar.optim import muon_matrices as mm
from fastpar.parallel import Replicate, Shard
from fastpar.reference.muon import MuonReference
from fastpar.testing import run_ranks

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: the flats' shard boundaries cut through the matrices
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 9), nn.LayerNorm(9))


def _loss(model: nn.Module, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 7, generator=g), torch.randn(6, 9, generator=g)
    return F.mse_loss(model(x.to(dtype)), y.to(dtype))


def _make(groups) -> Muon:
    return Muon(groups, lr=0.05, weight_decay=0.1)


def _single(dtype: torch.dtype = torch.float32, twin: bool = False) -> dict[str, torch.Tensor]:
    model = _model().to(dtype)
    if twin:
        tolerance.nudge(model, 0)
    opt = MuonReference(muon_param_groups(model, weight_decay=0.1), lr=0.05, weight_decay=0.1)
    for s in range(STEPS):
        opt.zero_grad()
        _loss(model, s, dtype).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _refs() -> dict[str, list]:
    runs = [_single(), _single(twin=True), _single(torch.float64)]
    return {n: [r[n] for r in runs] for n in runs[0]}


def _worst(model: nn.Module, refs: dict) -> dict[str, float]:
    """{parameter: error / bound} of the rule (at most 1: agree)."""
    out = {}
    for n, p in model.named_parameters():
        single, twin, exact = refs[n]
        c = tolerance.compare(p.detach(), [single, twin], exact, length=13, what=n)
        out[n] = c.ratio
    return out


def _gather_nothing(full, shard, flat) -> None:
    """The planted fault: the whole flat holds only this rank's shard (zeros elsewhere)."""
    full.zero_()
    full[flat.mine] = shard


def _dp(stage: int, ref: dict, fault: bool) -> dict:
    if fault:
        mm._all_gather = _gather_nothing
    model = _model()
    groups = muon_param_groups(model, weight_decay=0.1)
    if stage == 0:
        dp = Replicate(model, _make, param_groups=groups)
    else:
        unit = {"wrap": (nn.Linear,)} if stage == 3 else {}
        dp = Shard(model, _make, stage=stage, param_groups=groups, **unit)
    for s in range(STEPS):
        dp.zero_grad()
        _loss(dp, s).backward()
        dp.step()
    ctx = dp.summon_full_params() if stage == 3 else torch.no_grad()
    with ctx:
        out = _worst(model, ref)
    opt = dp.optimizer
    out["_bytes"] = dict(opt.comm_bytes)
    out["_load"] = opt.owner_load()
    return out


@pytest.mark.parametrize("stage", [1, 3, 0, 2])
def test_muon_zero_equals_single_device(stage):
    for out in run_ranks(_dp, 2, stage, _refs(), False):
        sent, load = out.pop("_bytes"), out.pop("_load")
        bad = {n: r for n, r in out.items() if not r <= 1.0}
        assert not bad, f"ZeRO-{stage}: parameters off the single-device Muon: {bad}"
        assert (sent["dp_gather"] > 0) == (stage > 0)
        if stage > 0:  # 7·13 + 13 + 13·9 + 9 + 9 + 9 elements in one flat: 2 matrices, 2 owners
            assert sorted(sorted(x) for x in load) == [[91 * 7, 117 * 9]]


def test_removing_the_gather_is_caught():
    for out in run_ranks(_dp, 2, 1, _refs(), True):
        out.pop("_bytes"), out.pop("_load")
        for n in ("0.weight", "2.weight"):
            assert out[n] > 100, f"{n} passed with each owner orthogonalising its shard only"
