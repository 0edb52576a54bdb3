"""Multi-token prediction (``fastpar.models.mtp``): the model's MTP loss and gradients against a
reference written here from DeepSeek-V3's definition (section 2.2), every gradient on every rank
against the single-process model at TP 2, PP 2 and TP 2 x PP 2 (depth 1 and 2, tied and untied,
packed documents and ignored targets), MTP off exactly today's model, and the refusals
(``fastpar.verify`` of the trainer with MTP: tests/test_verify_matrix.py).

The reference reuses the model's transformer blocks (the main model's and each depth's block,
tested on their own elsewhere) and writes the rest by hand: RMSNorm, the concatenation
[enorm(emb(t_{i+k})); hnorm(h^{k-1})], eh_proj, the final norm, the shared head, the
cross-entropy, which positions are targets (each depth runs on the positions i with i + k in
the row: the sequence is cut, not padded) and the normalisation (the main loss's denominator).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from _flags import tiny_config
from _parity import agree, exact_copy
from _trainer import FIRST_STEP, every_gradient_agrees, first_step_gradients, write_documents

from fastpar.models import LlamaConfig, build_llama, lm_loss
from fastpar.models.common import IGNORE_INDEX, Head
from fastpar.models.documents import documents
from fastpar.models.mtp import MTPHead, MTPOutput, mtp_loss, tokens
from fastpar.parity import reduction_length
from fastpar.tolerance import nudge
from fastpar.train import TrainConfig

BASE = dict(
    vocab_size=53,
    seq_len=12,
    hidden=24,
    heads=4,
    kv_heads=2,
    head_dim=6,
    ffn=20,
    layers=2,
    norm_eps=1e-5,
)


def _perturb_(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at one: move them, so a swapped or missing norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def _batch(cfg, seed: int = 7):
    """ids, targets with ignored ones, document ids [3, T] (documents of 1 to 6 tokens)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 3, cfg.seq_len
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    targets[torch.rand((b, t), generator=g) < 0.2] = IGNORE_INDEX
    docs = torch.cumsum(torch.rand((b, t), generator=g) < 0.3, dim=1)
    return ids, targets, docs


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _ce_sum(logits, target, valid):
    """Sum over the valid positions of -log softmax(logits)[target]."""
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * valid).sum()


def _reference_loss(model, cfg, ids, targets, doc_ids):
    """DeepSeek-V3's MTP objective, position by position: main CE + coef / D * sum_k CE_k, every
    CE summed over its valid targets and divided by the count of valid main targets."""
    blocks = list(model)
    embed, body, head = blocks[0], blocks[1:-1], blocks[-1]
    v, eps, d = cfg.vocab_size, cfg.norm_eps, cfg.mtp_depth
    w_emb, w_out = embed.tok.weight[:v], head.weight[:v]
    t = ids.shape[1]
    with documents(doc_ids):
        h = F.embedding(ids, w_emb)
        for block in body:
            h = block(h)
    valid0 = targets != IGNORE_INDEX
    main = _ce_sum(_rms(h, head.norm.weight, eps) @ w_out.T, targets, valid0)
    extra = 0.0
    for k in range(1, d + 1):
        layer, n = head.mtp[k - 1], t - k  # positions 0 .. t-k-1 have a token k ahead
        e = F.embedding(ids[:, k:], w_emb)
        x = torch.cat(
            (_rms(e, layer.enorm.weight, eps), _rms(h[:, :n], layer.hnorm.weight, eps)), -1
        )
        with documents(doc_ids[:, :n]):
            h = layer.block(x @ layer.eh_proj.weight.T)
        target = targets[:, k:]  # t_{i+k+1}: the main target of position i + k
        valid = (target != IGNORE_INDEX) & (doc_ids[:, :n] == doc_ids[:, k:])
        extra = extra + _ce_sum(_rms(h, layer.norm.weight, eps) @ w_out.T, target, valid)
    return (main + cfg.mtp_loss_coef / d * extra) / valid0.sum().clamp(min=1)


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*build_llama(cfg))
    _perturb_(model, seed + 1)
    return model


def _three(model):
    twin = exact_copy(model).float()
    nudge(twin, seed=1)
    return model, twin, exact_copy(model)


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_gradients_equal_the_papers_definition(depth, tied):
    cfg = LlamaConfig(**BASE, tie_embeddings=tied, mtp_depth=depth, mtp_loss_coef=0.3)
    model = _model(cfg)
    assert isinstance(model[-1], MTPHead) and len(model[-1].mtp) == depth
    ids, targets, doc_ids = _batch(cfg)
    runs = []
    for m in _three(model):
        m.zero_grad()
        loss = _reference_loss(m, cfg, ids, targets, doc_ids)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    model.zero_grad()
    with documents(doc_ids), tokens(ids):
        out = model(ids)
    assert isinstance(out, MTPOutput) and len(out.depths) == depth
    loss = mtp_loss(out, targets, cfg)
    loss.backward()
    length = reduction_length(model, ids)
    agree(loss, [r[0] for r in runs[:2]], runs[2][0], "MTP loss", length=length)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads = [r[1][name] for r in runs]
        agree(p.grad, grads[:2], grads[2], f"grad of {name}", length=length)
    # the embedding and the head are the main model's own parameters, not copies
    head = model[-1]
    assert head.embedding is model[0].tok.weight
    assert (head.weight is model[0].tok.weight) == tied


def test_every_target_is_counted_once_and_documents_stop_the_prediction():
    """The reference's position rule, on a batch built so that it matters: a depth-k target
    across a document boundary or past the row's end would change the loss."""
    cfg = LlamaConfig(**BASE, mtp_depth=2)
    model = _model(cfg)
    ids, targets, doc_ids = _batch(cfg)
    with documents(doc_ids), tokens(ids):
        with_docs = mtp_loss(model(ids), targets, cfg)
    with tokens(ids):  # the same rows as one document each: more depth-k targets
        one_doc = mtp_loss(model(ids), targets, cfg)
    ref_docs = _reference_loss(model, cfg, ids, targets, doc_ids)
    ref_one = _reference_loss(model, cfg, ids, targets, torch.zeros_like(doc_ids))
    length = reduction_length(model, ids)
    double = exact_copy(model)
    agree(
        with_docs,
        ref_docs,
        _reference_loss(double, cfg, ids, targets, doc_ids),
        "docs",
        length=length,
    )
    agree(
        one_doc,
        ref_one,
        _reference_loss(double, cfg, ids, targets, torch.zeros_like(doc_ids)),
        "rows",
        length=length,
    )
    assert abs(float((with_docs - one_doc).detach())) > 1e-3  # the boundaries matter here


def test_mtp_off_is_todays_model():
    cfg = LlamaConfig(**BASE)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*build_llama(cfg))
    assert type(plain[-1]) is Head
    torch.manual_seed(0)
    with_mtp = torch.nn.Sequential(*build_llama(dataclasses.replace(cfg, mtp_depth=2)))
    ours = dict(with_mtp.named_parameters())
    for name, p in plain.named_parameters():  # the main model: the same draw, bit for bit
        assert torch.equal(p, ours[name]), name
    ids, targets, _ = _batch(cfg)
    logits = plain(ids)
    assert torch.equal(mtp_loss(logits, targets, cfg), lm_loss(logits, targets, cfg))
    with_mtp.eval()  # eval: the main logits only, as the plain head's
    assert torch.equal(with_mtp(ids), logits)


def test_the_forward_without_its_token_ids_says_how():
    cfg = LlamaConfig(**BASE, mtp_depth=1)
    model = _model(cfg)
    ids = torch.zeros((2, cfg.seq_len), dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"mtp\.tokens\(ids\)"):
        model(ids)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mtp_depth=12), r"mtp_depth \(--mtp-depth\) 12 must be below seq_len 12"),
        (dict(mtp_depth=-1), r"mtp_depth .* >= 0"),
        (dict(mtp_loss_coef=0.3), r"mtp_loss_coef .* no effect without MTP"),
        (dict(mtp_depth=1, mtp_loss_coef=float("nan")), r"mtp_loss_coef .* finite"),
    ],
)
def test_what_cannot_be_exact_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**BASE, **kwargs}).check()


@pytest.mark.parametrize(
    "flags, match",
    [
        (
            dict(mtp_depth=1),
            r"--mtp-depth is a Llama and DeepSeek option: add --model llama or --model deepseek",
        ),
        (dict(model_type="llama", mtp_depth=64), r"must be below seq_len 64"),
        (dict(model_type="llama", mtp_depth=1, compile=True), r"--compile with --mtp-depth"),
    ],
)
def test_the_trainer_refuses_what_it_cannot_run(flags, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**flags).check()


# -- every gradient on every rank, through the trainer ------------------------------------------
SMALL = tiny_config(FIRST_STEP, moe_every=0, model_type="llama")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("mtp") / "docs.txt")


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=1, mtp_depth=2),
        dict(tp=1, pp=2, mtp_depth=2),
        dict(tp=2, pp=2, mtp_depth=1),
        dict(tp=2, pp=2, mtp_depth=2, untied=True),
        dict(tp=2, pp=2, mtp_depth=2, untied=True, fused_ce=True, sequence_parallel=True),
        pytest.param(  # (the interleaved MTP: also the slow tier's verify below)
            dict(tp=2, pp=2, mtp_depth=2, schedule="interleaved", virtual_stages=2, layers=4),
            marks=pytest.mark.slow,
        ),
        dict(tp=1, pp=2, mtp_depth=2, untied=True, schedule="zb-h1"),
        dict(tp=1, pp=2, mtp_depth=2, schedule="gpipe", recompute=True, fused_ce=True),
    ],
    ids=[
        "tp2",
        "pp2",
        "tp2-pp2-d1-tied",
        "tp2-pp2-d2-untied",
        "fused-ce-sp",
        "interleaved",
        "zb-h1",
        "gpipe-recompute-fused-ce",
    ],
)
def test_every_gradient_on_every_rank_is_the_single_process_models(data, layout):
    results = every_gradient_agrees(TrainConfig.from_flags(**{**SMALL, **layout}, data=data))
    assert sum(int(lines[0].split()[3]) for lines in results) > 0  # the last stage's MTP


def test_the_gradient_check_fails_without_the_embeddings_stage_sum(data, monkeypatch):
    """The check above can fail: the last stage's copy of the embedding (the MTP lookups, untied
    head) left without the first stage's gradient disagrees."""
    from fastpar.testing import run_ranks
    from fastpar.verify import references

    cfg = TrainConfig.from_flags(
        **{**SMALL, "tp": 1, "pp": 2, "mtp_depth": 1, "untied": True}, data=data
    )
    refs = references(cfg, None)
    lines = run_ranks(_no_tie, cfg.world_size, cfg, refs)
    assert any(len(r) > 1 and "0.tok.weight" in "\n".join(r) for r in lines), lines


def _no_tie(cfg, refs):
    import fastpar.train.build as build

    build.tie_across_stages = lambda p, mesh: None  # the copy is neither synced nor summed
    return first_step_gradients(cfg, refs)


# (fastpar.verify of the trainer with MTP: tests/test_verify_matrix.py's mtp1 cases)


# -- the trainer: the MTP loss logged on its own, checkpoints -----------------------------------
RUN = dict(SMALL, steps=3, dp=2, pp=2, tp=1, mtp_depth=2, lr_schedule="constant")


def test_the_logged_mtp_loss_is_what_its_coefficient_multiplies(data):
    """Step 1 (the same weights whatever the coefficient): the loss at coefficient 1 minus the
    loss at coefficient 0 is the logged mtp_loss, averaged over the replicas alike."""
    from _parity import assert_close

    from fastpar.train import launch

    one = launch(TrainConfig.from_flags(**{**RUN, "steps": 1, "mtp_loss_coef": 1.0}, data=data))[0]
    zero = launch(TrainConfig.from_flags(**{**RUN, "steps": 1, "mtp_loss_coef": 0.0}, data=data))[0]
    assert one["mtp_loss"] > 0
    assert_close(torch.tensor(one["loss"] - zero["loss"]), torch.tensor(one["mtp_loss"]), "mtp")
    assert_close(torch.tensor(zero["mtp_loss"]), torch.tensor(one["mtp_loss"]), "mtp at 0")


@pytest.mark.slow
def test_a_resumed_run_continues_as_the_uninterrupted_one(data, tmp_path):
    """The MTP modules and the last stage's embedding copy are saved and restored: a run
    resumed from step 2 trains step 3 as the run that never stopped."""
    from fastpar.train import launch

    whole = launch(TrainConfig.from_flags(**RUN, data=data))
    d = str(tmp_path / "ckpt")
    launch(TrainConfig.from_flags(**{**RUN, "steps": 2}, data=data, checkpoint_dir=d))
    resumed = launch(TrainConfig.from_flags(**RUN, data=data, checkpoint_dir=d, resume=True))
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["loss"] == whole[-1]["loss"]
    assert resumed[0]["mtp_loss"] == whole[-1]["mtp_loss"]
