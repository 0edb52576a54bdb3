"""``fastpar.optim.Muon`` on one device: its pure-torch reference against ``torch.optim.Muon``
(bit for bit in bf16, where both scale the update alike), the separate matrices of a stacked
parameter against orthogonalising each by hand, the default rule of which parameters Muon
takes, and the optimizer in fp32 against the reference in float64 by ``fastpar.tolerance``'s
rule (the reference in fp32 and its twin as the single-process runs)."""

from __future__ import annotations

import math

import pytest
import torch
from _model_runs import MOE_LLAMA
from torch import nn

from fastpar import tolerance
from fastpar.mesh.placement import mark_blocks, mark_expert
from fastpar.models import build_model
from fastpar.models.gpt import GPTConfig
from fastpar.models.llama import LlamaConfig
from fastpar.moe.config import ExpertConfig
from fastpar.optim import Muon, muon_param_groups
from fastpar.optim import muon as muon_module
from fastpar.optim.muon_matrices import blocks_of, owners, pieces
from fastpar.reference.muon import lr_ratio, muon_step_, newton_schulz, orthogonalize


@pytest.mark.parametrize("nesterov", [True, False])
def test_reference_is_torch_muon(nesterov):
    """Wide and square matrices ("original": ratio 1, so both add the same bf16 update): the
    reference in bf16 equals torch.optim.Muon bit for bit over three steps; a tall one (ratio
    sqrt(A/B) applied in another order) within two fp32 roundings of the step."""
    torch.manual_seed(0)
    for shape in [(5, 7), (6, 6), (9, 4)]:
        p = torch.randn(shape)
        q = p.clone().requires_grad_()
        ref = torch.optim.Muon(
            [q], lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="original"
        )
        buf = torch.zeros(shape)
        for _ in range(3):
            g = torch.randn(shape)
            q.grad = g.clone()
            ref.step()
            muon_step_(
                [p],
                [g],
                [buf],
                lr=0.02,
                weight_decay=0.1,
                nesterov=nesterov,
                adjust_lr="original",
                dtype=torch.bfloat16,
            )
        if shape[0] <= shape[1]:
            assert torch.equal(p, q.detach()), shape
        else:
            step = 0.02 * math.sqrt(9 / 4)
            assert (p - q.detach()).abs().max() <= 3 * 2**-24 * (p.abs().max() + step)


def test_lr_ratio_by_hand():
    assert lr_ratio((64, 256), "match_rms_adamw") == pytest.approx(0.2 * 16)
    assert lr_ratio((256, 64), "original") == pytest.approx(2.0)
    assert lr_ratio((64, 256), "original") == 1.0
    assert lr_ratio((3, 5), "none") == 1.0
    with pytest.raises(ValueError, match="adjust_lr 'rms'"):
        lr_ratio((3, 5), "rms")


def _by_hand(m: torch.Tensor) -> torch.Tensor:
    return newton_schulz(m) * (0.2 * math.sqrt(max(m.shape)))


def test_blocks_are_separate_matrices():
    """Fused q|k|v, a Llama q|k|v grouped by kv head, gate|up along the last dim of an expert
    stack: each matrix orthogonalised as if it stood alone (its own shape's ratio)."""
    torch.manual_seed(1)
    h = 4
    qkv = torch.randn(3 * h, h)
    q, k, v = qkv.chunk(3)
    want = torch.cat([_by_hand(q), _by_hand(k), _by_hand(v)])
    assert torch.equal(orthogonalize(qkv, (0, (h, h, h), 1)), want)
    # two kv groups of [q q | k | v] (rep 2, head dim 2): q is rows 0-3 and 8-11
    d, rows = 2, torch.randn(16, 5)
    g0, g1 = rows[:8], rows[8:]
    qs, ks, vs = (torch.cat([g0[a:b], g1[a:b]]) for a, b in ((0, 4), (4, 6), (6, 8)))
    o = orthogonalize(rows, (0, (2 * d, d, d), 2))
    oq, ok, ov = _by_hand(qs), _by_hand(ks), _by_hand(vs)
    assert torch.equal(o, torch.cat([oq[:4], ok[:2], ov[:2], oq[4:], ok[2:], ov[2:]]))
    # experts [E, H, 2F]: expert e's gate and up, each alone
    w1 = torch.randn(3, 5, 2 * 3)
    o = orthogonalize(w1, (2, (3, 3), 1))
    for e in range(3):
        assert torch.equal(o[e, :, :3], _by_hand(w1[e, :, :3]))
        assert torch.equal(o[e, :, 3:], _by_hand(w1[e, :, 3:]))
    with pytest.raises(ValueError, match="cover 9 rows, the tensor has 12"):
        orthogonalize(qkv, (0, (h, h, 1), 1))


def _llama() -> nn.Module:
    experts = ExpertConfig(expert="swiglu", shared_ffn_hidden_size=8)
    cfg = LlamaConfig(**MOE_LLAMA, num_experts=2, moe_experts=experts, mtp_depth=1)
    return nn.Sequential(*build_model(cfg))


def test_default_rule():
    """Hidden matrices (attention, MLP, experts, shared experts, the MTP projection) go to
    Muon; embeddings, the head, routers, norms, biases to AdamW."""
    torch.manual_seed(0)
    model = _llama()
    groups = muon_param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in groups if g["muon"] for p in g["params"])
    adamw = sorted(names[id(p)] for g in groups if not g["muon"] for p in g["params"])
    assert sorted(muon + adamw) == sorted(names.values())
    assert not [n for n in muon if "norm" in n or "router" in n or n.startswith(("0.", "3.w"))]
    for part in (
        "attn.qkv",
        "attn.o",
        "mlp.gate_up",
        "mlp.down",
        "mlp.w1",
        "mlp.w2",
        "shared.w1",
        "eh_proj",
        "block.attn.qkv",
    ):
        assert any(part in n for n in muon), part
    assert {"0.tok.weight", "3.weight", "2.mlp.router.weight"} <= set(adamw)
    assert blocks_of(model[1].attn.qkv.weight) == (0, (8, 4, 4), 2)
    assert blocks_of(model[1].mlp.gate_up.weight) == (0, (64, 64), 1)
    assert blocks_of(model[2].mlp.w1) == (2, (64, 64), 1)


def test_refusals():
    with pytest.raises(ValueError, match=r"a parameter of shape \(4,\) in a 'muon' group"):
        p = nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        Muon([{"params": [p], "muon": True}]).step()
    with pytest.raises(ValueError, match="adjust_lr 'x' must be one of"):
        Muon([nn.Parameter(torch.ones(2, 2))], adjust_lr="x")


def test_owners_balance():
    """Costliest first to the least-loaded rank (ties: the lowest): 9 | 5+3+1 | 4+3+2."""
    assert owners([9, 5, 4, 3, 3, 2, 1], 3) == [0, 1, 2, 2, 1, 2, 1]


def test_experts_are_owned_apart():
    """A flat's units of ownership: each expert of a stack (its share of the stack's cost),
    every other parameter whole; four experts and a matrix over two ranks balance."""
    w1, w = torch.zeros(4, 8, 16), torch.zeros(16, 16)
    mark_expert(w1)

    class Flat:
        params, shapes = [w1, w], [w1.shape, w.shape]

    units = pieces(Flat)
    assert units == [((0, e), 8 * 16 * 8) for e in range(4)] + [((1, None), 16**3)]
    assert owners([c for _, c in units], 2) == [1, 1, 1, 1, 0]


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)


def _reference(model: nn.Module, steps: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Muon's reference on the hidden matrices, torch.optim.AdamW on the rest, in ``dtype``."""
    groups = muon_param_groups(model, weight_decay=0.1)
    adam = torch.optim.AdamW([g for g in groups if not g["muon"]], lr=0.01, foreach=False)
    mats = [p for g in groups if g["muon"] for p in g["params"]]
    bufs = [torch.zeros_like(p) for p in mats]
    for s in range(steps):
        _grads(model, s)
        adam.step()
        muon_step_(
            mats,
            [p.grad for p in mats],
            bufs,
            lr=0.01,
            weight_decay=0.1,
            blocks=[blocks_of(p) for p in mats],
        )
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_muon_fp32_agrees_with_float64():
    """Three steps of a tiny Llama MoE (fused q|k|v by kv group, gate|up, experts): every
    parameter of Muon in fp32 against the reference in float64, beside the reference in fp32
    and its twin (one rounding away)."""
    runs = {}
    for key, dtype, twin in (
        ("exact", torch.float64, False),
        ("single", torch.float32, False),
        ("twin", torch.float32, True),
    ):
        torch.manual_seed(0)
        model = _llama().to(dtype)
        if twin:
            tolerance.nudge(model, 0)
        runs[key] = _reference(model, 3, dtype)
    torch.manual_seed(0)
    model = _llama()
    opt = Muon(muon_param_groups(model, weight_decay=0.1), lr=0.01)
    for s in range(3):
        _grads(model, s)
        opt.step()
    width = max(max(p.shape) for p in model.parameters())
    for name, p in model.named_parameters():
        singles = [runs["single"][name], runs["twin"][name]]
        tolerance.assert_agree(p, singles, runs["exact"][name], length=width, what=name)
    state = opt.state[model[1].attn.qkv.weight]
    assert set(state) == {"momentum_buffer"}
    assert set(opt.state[model[1].norm1.weight]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("on_device", [False, True])
def test_found_inf_skips_everything(monkeypatch, on_device):
    """A raised flag leaves every tensor as it was; a clear one steps as without a flag —
    read on the host (a CPU flag), or decided on the device (``torch.where``, forced here)."""
    if on_device:
        monkeypatch.setattr(muon_module, "skip_on_host", lambda f: None if f is not None else False)
    ends = {}
    for flag in (None, 1.0, 0.0):
        torch.manual_seed(0)
        model = _llama()
        opt = Muon(muon_param_groups(model), lr=0.01)
        for s in range(2):
            _grads(model, s)
            opt.found_inf = None if flag is None or s == 0 else torch.full((), flag)
            opt.step()
        ends[flag] = {n: p.detach().clone() for n, p in model.named_parameters()}
        bufs = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
        ends[flag]["_buf"] = torch.cat([b.reshape(-1) for b in bufs if b is not None])
    torch.manual_seed(0)
    model = _llama()
    opt = Muon(muon_param_groups(model), lr=0.01)
    _grads(model, 0)
    opt.step()
    after_one = {n: p.detach() for n, p in model.named_parameters()}
    for n in after_one:
        assert torch.equal(ends[1.0][n], after_one[n]), n  # step 2 skipped
        assert torch.equal(ends[0.0][n], ends[None][n]), n  # step 2 taken
    assert torch.equal(ends[0.0]["_buf"], ends[None]["_buf"])


def test_mark_blocks_wins_over_fused():
    p = nn.Parameter(torch.zeros(6, 2))
    mark_blocks(p, 0, (2, 4))
    assert blocks_of(p) == (0, (2, 4), 1)


def test_expert_biases_are_vectors():
    """An expert stack's [E, F] bias is E vectors: AdamW by default, refused in a Muon group."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1, moe_every=1)
    model = nn.Sequential(*build_model(cfg))
    groups = muon_param_groups(model)
    muon = {id(p) for g in groups if g["muon"] for p in g["params"]}
    moe = model[1].mlp
    assert id(moe.w1) in muon and id(moe.b1) not in muon and id(moe.b2) not in muon
    moe.b1.grad = torch.ones_like(moe.b1)
    with pytest.raises(ValueError, match=r"an expert stack of shape \(4, 64\) in a 'muon'"):
        Muon([{"params": [moe.b1], "muon": True}]).step()
