"""Selective recompute (``fastpar.parallel.pipeline.recompute``): every policy gives the loss and
every gradient of the model that keeps all its activations — without a pipeline, and at pp 2
under GPipe, 1F1B and interleaved 1F1B — on GPT and on Llama with MoE blocks (auxiliary loss on);
dropout masks are replayed; the CLI's --recompute words; fastpar.verify at tp2 x pp2 x dp2 (mlp,
every:K; attention: tests/test_verify_matrix.py).

A recomputed forward runs the kernels the first forward ran on the same inputs, so one process
with and without a policy gives the same bits: compared for equality. The pipelined runs against
the unpipelined model are judged by ``fastpar.tolerance``'s rule (the engine sums the
micro-batch losses itself), against the unpipelined model in float64 beside its fp32 run."""

from __future__ import annotations

import pytest
import torch
from _flags import tiny_config
from _mesh import make_mesh
from _parity import agree
from torch import nn

from fastpar.models import GPTConfig, LlamaConfig, build_gpt, build_llama, lm_loss
from fastpar.moe import MoE
from fastpar.parallel.pipeline import (
    PipelineEngine,
    RecomputePolicy,
    apply_recompute,
    build_stage,
    build_virtual_stages,
    make_schedule,
)
from fastpar.testing import run_ranks
from fastpar.train.cli import build_parser
from fastpar.train.config import TrainConfig, config_from

SELECTIVE = ("attention", "mlp", "every:2")
M = 4  # micro-batches
GPT = GPTConfig(vocab_size=48, seq_len=8, hidden=32, heads=4, layers=4, tie_embeddings=False)
LLAMA = LlamaConfig(
    vocab_size=48,
    seq_len=8,
    hidden=32,
    heads=4,
    kv_heads=2,
    layers=4,
    ffn=64,
    moe_every=2,
    num_experts=4,
    top_k=2,
)
MODELS = {"gpt": (GPT, build_gpt), "llama": (LLAMA, build_llama)}


def _data(seed: int = 0, batch: int = 8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 48, (batch, 8), generator=g)
    return x, torch.randint(0, 48, (batch, 8), generator=g)


def _with_dropout(blocks: list[nn.Module], p: float = 0.25) -> list[nn.Module]:
    """Dropout after every block's attention and MLP (fastpar's models have none)."""
    for b in blocks[1:-1]:
        b.attn = nn.Sequential(b.attn, nn.Dropout(p))
        b.mlp = nn.Sequential(b.mlp, nn.Dropout(p))
    return blocks


def _model(name: str, mesh=None, dropout: bool = False) -> list[nn.Module]:
    cfg, make = MODELS[name]
    torch.manual_seed(0)
    blocks = make(cfg, mesh)
    return _with_dropout(blocks) if dropout else blocks


def _single(name, policy, *, dropout=False, seed=0, mesh=None, dtype=torch.float32):
    """Loss, {global name: grad}, MoE stats and saved bytes of the unpipelined model, M
    micro-batches, the MoE auxiliary loss weighted 1 / M, under ``policy`` (``mesh``: one
    without TP, inside ranks; ``dtype``: float64 for the exact math)."""
    cfg = MODELS[name][0]
    blocks = [b.to(dtype) for b in _model(name, mesh, dropout)]
    apply_recompute(blocks[1:-1], policy)
    model = nn.Sequential(*blocks)
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = 1.0 / M
    x, y = _data()
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(seed)
    total = 0.0
    for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(model(xc), yc, cfg, mesh) / M
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = [m.stats["counts"].clone() for m in model.modules() if isinstance(m, MoE)]
    return total, grads, stats, saved[0]


def _equal(a: dict, b: dict) -> None:
    """Bit for bit: the same kernels on the same inputs (a recomputed forward replays them)."""
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def _agree(grads: dict, single: dict, exact: dict, length: int, where: str) -> None:
    """The rule on every gradient: ``grads`` against ``single`` (fp32) and ``exact``."""
    assert grads.keys() <= single.keys()
    for n, g in grads.items():
        agree(g, single[n], exact[n], f"{where}: gradient {n}", length=length)


def _length(name: str) -> int:
    """The longest reduction: the batch's 64 tokens or the widest layer (the FFN, the head)."""
    return max(64, *(max(p.shape) for b in _model(name) for p in b.parameters()))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_unpipelined_policies_equal_no_recompute(name):
    loss0, grads0, stats0, bytes0 = _single(name, "none")
    assert any(g.abs().sum() > 0 for n, g in grads0.items() if "router" in n) or name == "gpt"
    for policy in SELECTIVE:
        loss, grads, stats, nbytes = _single(name, policy)
        assert loss == loss0, policy  # the same forwards, the same backwards: bit for bit
        _equal(grads, grads0)
        for a, b in zip(stats, stats0, strict=True):  # the last micro-batch's, not a recompute's
            assert torch.equal(a, b)
        assert nbytes < bytes0, f"{policy} saved {nbytes} bytes, no recompute {bytes0}"


def test_dropout_masks_replayed_unpipelined():
    _, kept, _, _ = _single("gpt", "none", dropout=True, seed=5)
    _, other, _, _ = _single("gpt", "none", dropout=True, seed=6)
    assert any(not torch.equal(kept[n], other[n]) for n in kept)  # the masks are live
    for policy in SELECTIVE:
        _, grads, _, _ = _single("gpt", policy, dropout=True, seed=5)
        _equal(grads, kept)


def _reference(name: str, dtype=torch.float32):
    loss, grads, _, _ = _single(name, "none", mesh=make_mesh(pp=1), dtype=dtype)
    return loss, grads


def _pipelined(name, policy, schedule, dropout=False, seed=0):
    """This rank's (loss, {global name: grad}, MoE stats) under a pp 2 engine."""
    cfg = MODELS[name][0]
    mesh = make_mesh(pp=2)
    blocks = _model(name, mesh, dropout)
    apply_recompute(blocks[1:-1], policy)
    v = 2 if schedule == "interleaved" else 1
    costs = [1.0] * len(blocks)
    if v > 1:
        stage, ranges = build_virtual_stages(blocks, 2, mesh.pp_rank, v, costs=costs)
    else:
        stage, rng = build_stage(blocks, 2, mesh.pp_rank, costs=costs)
        ranges = [rng]
    engine = PipelineEngine(
        stage,
        mesh,
        make_schedule(schedule, M, v),
        loss_fn=lambda o, t: lm_loss(o, t, cfg, mesh),
        recompute=RecomputePolicy.parse(policy).kind == "full",
    )
    x, y = _data()
    torch.manual_seed(seed)
    loss = engine.train_step(x if mesh.is_first_stage else None, y if mesh.is_last_stage else None)
    grads = {
        f"{k}.{n}": p.grad.clone()
        for s, e in ranges
        for k in range(s, e)
        for n, p in blocks[k].named_parameters()
    }
    stats = [m.stats["counts"].clone() for m in stage.modules() if isinstance(m, MoE)]
    return float(loss), grads, stats


def _pipelined_parity() -> None:
    for name in MODELS:
        (loss0, ref), (loss64, ref64) = _reference(name), _reference(name, torch.float64)
        n = _length(name)
        for schedule in ("gpipe", "1f1b", "interleaved"):
            _, _, stats0 = _pipelined(name, "none", schedule)
            for policy in ("full", *SELECTIVE):
                where = f"{name}, {schedule}, {policy}"
                loss, grads, stats = _pipelined(name, policy, schedule)
                agree(loss, loss0, loss64, f"{where}: loss", length=n)
                _agree(grads, ref, ref64, n, where)
                if policy != "full":  # the step's last forward's routing, not a recompute's
                    for a, b in zip(stats, stats0, strict=True):
                        assert torch.equal(a, b), (name, schedule, policy)
    # dropout: the same masks as the run that keeps everything, under the same seed
    _, kept, _ = _pipelined("gpt", "none", "1f1b", dropout=True, seed=5)
    _, other, _ = _pipelined("gpt", "none", "1f1b", dropout=True, seed=6)
    assert any(not torch.equal(kept[n], other[n]) for n in kept)
    for policy in SELECTIVE:  # the same engine, the same masks: bit for bit
        _, grads, _ = _pipelined("gpt", policy, "1f1b", dropout=True, seed=5)
        _equal(grads, kept)


def test_pp2_every_schedule_and_policy_equals_unpipelined():
    run_ranks(_pipelined_parity, 2)


def test_policy_words_and_cli():
    assert str(RecomputePolicy.parse("every:3")) == "every:3"
    assert RecomputePolicy.parse(True).kind == "full" and not RecomputePolicy.parse(None).selective
    for bad in ("every:0", "every:x", "attn", "all"):
        with pytest.raises(ValueError, match="--recompute"):
            RecomputePolicy.parse(bad)
    ap = build_parser()

    def parsed(*argv):
        return config_from(ap.parse_args(list(argv)), world=None).recompute

    assert parsed() is False and parsed("--recompute") is True  # as before
    assert parsed("--no-recompute") is False and parsed("--recompute", "none") is False
    assert parsed("--recompute", "full") is True
    assert parsed("--recompute", "attention") == "attention"
    assert parsed("--recompute", "every:2") == "every:2"
    with pytest.raises(ValueError, match="every:K"):
        TrainConfig.from_flags(recompute="every:0", dp=1, tp=1, pp=1, ep=1).check()


def test_refuses_a_block_without_the_submodule():
    with pytest.raises(ValueError, match="no attention sub-module"):
        apply_recompute([nn.Linear(2, 2)], "attention")


@pytest.mark.parametrize(
    "policy, layout",
    [  # (attention: tests/test_verify_matrix.py's attn cases)
        ("mlp", dict(tp=2, pp=2, dp=2, zero=2, schedule="interleaved", virtual_stages=2)),
        ("every:1", dict(tp=1, pp=2, dp=2, zero=3, schedule="gpipe")),
    ],
    ids=["tp2-pp2-dp2-z2-interleaved-mlp", "pp2-dp2-z3-every1"],
)
def test_verify_composes_with_tp_dp_ep_zero(policy, layout):
    """fastpar.verify's reference keeps every activation (``build`` without a mesh)."""
    from fastpar.verify import compare

    cfg = TrainConfig.from_flags(
        **tiny_config(layout, model_type="llama", ep=2, microbatches=2, moe_every=2),
        recompute=policy,
    )
    ok, report = compare(cfg)
    assert ok, report
    assert f"recompute {policy}" in report


def _moe_reverse(policy: str):
    """Two micro-batches forward, then their backwards in reverse order: grads, and the MoE
    layers' stats and aux losses as the last forward (micro-batch 1) left them."""
    blocks = _model("llama")
    apply_recompute(blocks[1:-1], policy)
    model = nn.Sequential(*blocks)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.aux_loss_scale = 0.5
    x, y = _data()
    pairs = zip(x.chunk(2), y.chunk(2), strict=True)
    losses = [lm_loss(model(xc), yc, LLAMA) / 2 for xc, yc in pairs]
    for loss in reversed(losses):
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, [(m.stats["counts"].clone(), m.aux_loss.detach().clone()) for m in moes]


def test_moe_state_is_the_last_forwards_after_a_recompute():
    grads0, state0 = _moe_reverse("none")
    for policy in ("mlp", "every:1"):  # a recompute replays the kernels: bit for bit
        grads, state = _moe_reverse(policy)
        _equal(grads, grads0)
        for (c, a), (c0, a0) in zip(state, state0, strict=True):
            assert torch.equal(c, c0) and torch.equal(a, a0), policy
