"""``Muon(per_head=True)``: each attention head of a ``mark_heads`` weight (fastpar's GPT fused
q|k|v and Llama q|k|v by rows, their output projections by columns) is its own matrix. On one
device it equals orthogonalising each head's rows / columns by hand with the reference
Newton–Schulz, bit for bit; at TP 2 it equals single-device per-head Muon bit for bit (the heads
in whole-tensor coordinates after the gather); at ZeRO-1 dp 2 it agrees with the single-device
per-head reference by ``fastpar.tolerance``; ignoring ``per_head`` on the distributed side is
caught; ``--muon-per-head`` reaches ``Muon`` and ``ExactMuon`` and is refused where no heads are
marked; ``fastpar.verify`` DISAGREEs with the fault (slow; it AGREEs without:
tests/test_verify_matrix.py's muonheads cases)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _flags import tiny_config
from _mesh import make_mesh
from _parity import local_slice
from torch import nn

from fastpar import tolerance
from fastpar.mesh.placement import mark_blocks, mark_heads, matrix_heads, param_layout
from fastpar.models import build_model
from fastpar.models.gpt import GPTConfig
from fastpar.models.llama import LlamaConfig
from fastpar.optim import Muon, muon_param_groups
from fastpar.optim import muon_matrices as mm
from fastpar.parallel import Shard
from fastpar.reference.muon import MuonReference, head_blocks, newton_schulz
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, build_parser
from fastpar.train.optimizers import exact_optimizer, groups_for, muon_factory

GPT = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, layers=1)
LLAMA = LlamaConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, layers=1)
CONFIGS = {"gpt": GPT, "llama": LLAMA}
HEADS = {
    "gpt": ("attn.qkv.weight", "attn.proj.weight"),
    "llama": ("attn.qkv.weight", "attn.o.weight"),
}
LR, MOM, WD = 0.02, 0.95, 0.1


def _grads(model: nn.Module, step: int, cut: bool) -> None:
    """Whole random gradients, each rank's TP part of them when ``cut``."""
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        shape, layout = list(p.shape), param_layout(p)
        split = layout is not None and layout.kind == "sharded" and layout.group is not None
        if split:
            shape[layout.dim] = layout.full_size
        g = torch.randn(shape, generator=gen)
        p.grad = local_slice(g, p, layout.fused) if cut and split else g


def _by_hand(w: torch.Tensor, g: torch.Tensor, dim: int, d: int) -> torch.Tensor:
    """One Muon step from zero momentum, each ``d`` rows (dim 0) or columns (dim 1) alone."""
    u = g.lerp(torch.zeros_like(g).lerp(g, 1 - MOM), MOM)  # Nesterov
    o = torch.empty_like(u)
    for h in range(u.shape[dim] // d):
        part = u.narrow(dim, h * d, d)
        o.narrow(dim, h * d, d).copy_(newton_schulz(part) * (0.2 * math.sqrt(max(part.shape))))
    return w.mul(1 - LR * WD).add_(o, alpha=-LR)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_head_is_each_head_by_hand(name):
    """Every head-marked weight equals its heads orthogonalised one by one; per_head off still
    takes q, k, v (and the output projection) whole, so it differs there and nowhere else."""
    torch.manual_seed(0)
    model = nn.Sequential(*build_model(CONFIGS[name]))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    d = CONFIGS[name].hidden // CONFIGS[name].heads
    _grads(model, 0, cut=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    Muon(muon_param_groups(model, WD), lr=LR, momentum=MOM, per_head=True).step()
    per_head = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    Muon(muon_param_groups(model, WD), lr=LR, momentum=MOM).step()
    qkv, out = (f"1.{s}" for s in HEADS[name])
    for n, dim in ((qkv, 0), (out, 1)):
        assert torch.equal(per_head[n], _by_hand(start[n], grads[n], dim, d)), n
    for n, p in model.named_parameters():
        same = torch.equal(per_head[n], p.detach())
        assert same == (n not in (qkv, out)), n


def test_heads_must_refine_the_blocks():
    heads = type("H", (), {"dim": 0, "size": 3})()
    assert head_blocks((0, (6, 3), 2), heads, (18, 4)) == (0, (3,) * 6, 1)
    assert head_blocks((0, (6, 3), 1), None, (9, 4)) == (0, (6, 3), 1)
    with pytest.raises(ValueError, match="do not refine the matrix blocks"):
        head_blocks((0, (4, 8), 1), heads, (12, 4))
    with pytest.raises(ValueError, match="do not refine the matrix blocks"):
        head_blocks((1, (2, 2), 1), heads, (9, 4))
    with pytest.raises(ValueError, match="do not tile"):
        head_blocks(None, heads, (8, 4))


def _train(model: nn.Module, cut: bool) -> None:
    opt = Muon(muon_param_groups(model, WD), lr=LR, momentum=MOM, per_head=True)
    for step in range(2):
        _grads(model, step, cut)
        opt.step()


def _single(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    whole = nn.Sequential(*build_model(CONFIGS[name]))
    _train(whole, cut=False)
    return {n: p.detach().clone() for n, p in whole.named_parameters()}


def _ignore_heads(blocks, heads, shape):
    return blocks


def _tp(name: str, ref: dict, fault: bool) -> dict[str, float]:
    """{parameter: max |TP 2 - single-device cut|} after two per-head Muon steps."""
    if fault:  # the planted fault: the distributed side ignores per_head
        mm.head_blocks = _ignore_heads
    mesh = make_mesh(tp=2)
    torch.manual_seed(0)
    par = nn.Sequential(*build_model(CONFIGS[name], mesh))
    _train(par, cut=True)
    out = {}
    for n, p in par.named_parameters():
        layout = param_layout(p)
        split = layout is not None and layout.kind == "sharded" and layout.group is not None
        want = local_slice(ref[n], p, layout.fused) if split else ref[n]
        out[n] = float((p.detach() - want).abs().max())
    assert dist.get_world_size() == 2
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_head_tp2_equals_single_device(name):
    for out in run_ranks(_tp, 2, name, _single(name), False):
        bad = {n: e for n, e in out.items() if e != 0.0}
        assert not bad, f"{name}: parameters off single-device per-head Muon: {bad}"


def test_ignoring_per_head_under_tp_is_caught():
    for out in run_ranks(_tp, 2, "llama", _single("llama"), True):
        for n in HEADS["llama"]:
            assert out[f"1.{n}"] > 1e-4, f"{n} passed with per_head ignored at TP 2"


def _mlp() -> nn.Module:
    """Two 'attention' weights with heads of 3 (odd sizes: ZeRO's shards cut through them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 12, bias=False), nn.Tanh(), nn.Linear(12, 9, bias=False))
    mark_heads(model[0].weight, 0, 3)
    mark_blocks(model[0].weight, 0, (6, 6))
    mark_heads(model[2].weight, 1, 3)
    return model


def _loss(model: nn.Module, step: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 7, generator=g), torch.randn(6, 9, generator=g)
    return F.mse_loss(model(x.to(dtype)), y.to(dtype))


def _zero_ref(dtype=torch.float32, twin=False) -> dict[str, torch.Tensor]:
    model = _mlp().to(dtype)
    if twin:
        tolerance.nudge(model, 0)
    groups = muon_param_groups(model, WD)
    opt = MuonReference(groups, lr=0.05, weight_decay=WD, per_head=True, heads=matrix_heads)
    for s in range(3):
        opt.zero_grad()
        _loss(model, s, dtype).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero(refs: dict, fault: bool) -> dict[str, float]:
    if fault:
        mm.head_blocks = _ignore_heads
    model = _mlp()
    make = lambda groups: Muon(groups, lr=0.05, weight_decay=WD, per_head=True)  # noqa: E731
    dp = Shard(model, make, stage=1, param_groups=muon_param_groups(model, WD))
    for s in range(3):
        dp.zero_grad()
        _loss(dp, s).backward()
        dp.step()
    out = {}
    for n, p in model.named_parameters():
        single, twin, exact = refs[n]
        out[n] = tolerance.compare(p.detach(), [single, twin], exact, length=12, what=n).ratio
    return out


@pytest.mark.parametrize("fault", [False, True])
def test_per_head_zero1_dp2_agrees(fault):
    runs = [_zero_ref(), _zero_ref(twin=True), _zero_ref(torch.float64)]
    refs = {n: [r[n] for r in runs] for n in runs[0]}
    for out in run_ranks(_zero, 2, refs, fault):
        if not fault:
            assert all(r <= 1.0 for r in out.values()), out
        else:  # per_head ignored by the flats' owners: off by the size of an update
            assert all(r > 100 for r in out.values()), out


def test_flag_reaches_muon_and_its_reference():
    assert build_parser().parse_args(["--muon-per-head"]).muon_per_head is True
    cfg = TrainConfig.from_flags(
        optimizer="muon", muon_per_head=True, model_type="llama", tp=1, pp=1
    )
    model = nn.Sequential(*build_model(LLAMA))
    groups = groups_for(cfg, model, None)
    assert muon_factory(cfg)(groups).defaults["per_head"] is True
    exact = groups_for(cfg, nn.Sequential(*build_model(LLAMA)).double(), None)
    assert exact_optimizer(cfg, exact, None).optimizer.per_head is True
    off = TrainConfig.from_flags(optimizer="muon", model_type="llama", tp=1, pp=1)
    assert muon_factory(off)(groups).defaults["per_head"] is False
    for bad in (dict(model_type="deepseek"), dict(optimizer="adamw")):
        cfg = TrainConfig.from_flags(
            **{"optimizer": "muon", "muon_per_head": True, "tp": 1, "pp": 1, **bad}
        )
        with pytest.raises(ValueError, match="--muon-per-head with --optimizer"):
            groups_for(cfg, model, lambda stage, wd: [])


SMALL = tiny_config(steps=3, seq_len=32)


# (fastpar.verify with --muon-per-head: tests/test_verify_matrix.py's muonheads cases)


@pytest.mark.slow
def test_verify_catches_per_head_ignored(monkeypatch):
    """The ranks fork from here: the distributed Muon (world > 1 only; the single-process run
    keeps its heads) treating q|k|v and the output projection whole DISAGREEs."""
    from fastpar.verify import compare

    def distributed_ignores(blocks, heads, shape):
        if dist.is_initialized() and dist.get_world_size() > 1:
            return blocks
        return head_blocks(blocks, heads, shape)

    monkeypatch.setattr(mm, "head_blocks", distributed_ignores)
    layout = dict(tp=2, pp=1, dp=2, ep=1, zero=1, moe_every=0, model_type="gpt")
    cfg = TrainConfig.from_flags(**{**SMALL, **layout, "optimizer": "muon", "muon_per_head": True})
    ok, text = compare(cfg)
    assert not ok and "DISAGREE" in text, text


@pytest.mark.slow
def test_resume_refuses_another_per_head(tmp_path):
    from fastpar.train import launch

    layout = dict(tp=1, pp=1, dp=2, ep=1, zero=1, moe_every=0, optimizer="muon")
    base = {**SMALL, **layout, "steps": 2, "checkpoint_dir": str(tmp_path), "save_every": 2}
    launch(TrainConfig.from_flags(**base))
    with pytest.raises(Exception, match="--muon-per-head False -> True"):
        launch(
            TrainConfig.from_flags(**{**base, "steps": 3, "resume": True, "muon_per_head": True})
        )
