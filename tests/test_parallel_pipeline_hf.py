"""Hugging Face decoders pipelined with ``hf_decoder_blocks`` equal the unpipelined HF model on
the same batch: the loss and every parameter gradient on every rank (fp32), for Llama and Qwen3
at PP = 2 and PP 2 x TP 2 (GPipe and 1F1B, several micro-batches, with and without
recomputation), tied embeddings, the other supported families (Mistral and Qwen2 with sliding
windows, Mixtral, Qwen3-MoE), padding masks; and the errors.

A pipeline sums micro-batch gradients, TP adds partial sums: not the unpipelined model's bits.
"Equal" is ``fastpar.tolerance``'s rule: each step's loss and every gradient on every rank
against the same training in float64 (the HF model ``.double()`` with SDPA attention; HF
computes RoPE's angles in fp32 even then, the same values in every run), beside the fp32 run and
its twin (``references`` / ``check`` of tests/_training.py). The blocks in sequence run
the model's own kernels in its order: they equal it bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _hf import GQA, VOCAB, build, transformers
from _mesh import make_mesh
from _parity import agree, exact_copy
from _training import check, references, sliced
from torch import nn

from fastpar import parallelize
from fastpar.parallel.pipeline import GPipe, OneFOneB, PipelineEngine, build_stage
from fastpar.parallel.pipeline.hf import (
    hf_decoder_blocks,
    hf_named_parameters,
    hf_tie_across_stages,
)
from fastpar.testing import RankError, run_ranks

SEQ, BATCH = 6, 12
PLAN = {
    "*.q_proj": "column",
    "*.k_proj": "column",
    "*.v_proj": "column",
    "*.gate_proj": "column",
    "*.up_proj": "column",
    "*.o_proj": "row",
    "*.down_proj": "row",
    "model.embed_tokens": "vocab",
    "lm_head": ("column", {"gather_output": True, "pad_output": True}),
}
WINDOWS = {  # sliding windows shorter than SEQ, so the sliding mask differs from the causal one
    "mistral": dict(sliding_window=3),
    "qwen2": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),  # both kinds
}


def hf_model(family: str, attn: str, tie: bool = False, **overrides) -> nn.Module:
    """tests/_hf.py's small model of ``family`` (2 layers, GQA, an odd vocabulary), untied
    unless ``tie``, with attention implementation ``attn``."""
    model = build(family, tie_word_embeddings=tie, **{**WINDOWS.get(family, {}), **overrides})
    model.set_attn_implementation(attn)
    return model


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # ignores -100 (padding)


def hf_batch(step: int, pad: int = 0):
    """Token ids, targets and (with ``pad``) a left-padding mask with ``pad`` padded tokens in
    every row — so each micro-batch's loss averages over as many tokens as the others."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if not pad:
        return ids, None, targets
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[:, :pad] = 0
    return ids, mask, targets.masked_fill(mask == 0, -100)


def _loss(pad: int):
    """``loss(model, step, dtype)`` of the unpipelined HF model on ``hf_batch(step, pad)``. The
    float64 run computes the same math with HF's SDPA attention (eager attention takes its
    softmax in fp32, where float64's mask value -1.8e308 becomes -inf: a fully padded row, all
    -inf, is NaN) and a MoE model with HF's eager experts (a loop of per-expert products:
    torch._grouped_mm, HF's default, takes no float64)."""

    def loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.float64:
            if model.config._attn_implementation == "eager":
                model.set_attn_implementation("sdpa")
            if model.config._experts_implementation not in (None, "eager"):
                model.set_experts_implementation("eager")
        ids, mask, targets = hf_batch(step, pad)
        return loss_fn(model(ids, attention_mask=mask, use_cache=False).logits, targets)

    return loss


def hf_references(family: str, attn: str, tie: bool = False, pad: int = 0):
    """Two SGD steps (lr 0.5) of the unpipelined model: fp32, its twin, float64; the longest
    reduction is the vocabulary (beside 72 tokens, width 32, FFN 40)."""
    return references(
        lambda: hf_model(family, attn, tie),
        _loss(pad),
        2,
        lambda model: torch.optim.SGD(model.parameters(), lr=0.5),
        length=max(VOCAB, BATCH * SEQ),
    )


def _pipelined(
    family: str,
    attn: str,
    tp: int,
    schedule: str,
    m: int,
    refs,
    recompute: bool = False,
    tie: bool = False,
    pad: int = 0,
) -> list[str]:
    mesh = make_mesh(tp=tp, pp=torch.distributed.get_world_size() // tp)
    model = hf_model(family, attn, tie)
    hidden = model.config.hidden_size
    if tp > 1:
        parallelize(model, PLAN, mesh=mesh)
    blocks = hf_decoder_blocks(model)
    stage, _ = build_stage(blocks, mesh.pp_size, mesh.pp_rank)
    tied = hf_tie_across_stages(blocks, mesh)
    assert (tied is not None) == (tie and (mesh.is_first_stage or mesh.is_last_stage))
    sched = GPipe(m) if schedule == "gpipe" else OneFOneB(m)
    engine = PipelineEngine(
        stage,
        mesh,
        sched,
        loss_fn=loss_fn,
        recompute=recompute,
        tied=[] if tied is None else [tied],
    )
    # the references name a tied lm_head.weight too (the last stage's copy)
    params = dict(hf_named_parameters(stage))
    sliced(refs, params)  # each rank's TP slice of the dense gradients
    opt_s = torch.optim.SGD(stage.parameters(), lr=0.5)
    for step in range(2):
        ids, mask, targets = hf_batch(step, pad)
        opt_s.zero_grad()
        sent = engine.p2p.bytes_sent
        loss_p = engine.train_step(ids if mask is None else (ids, mask), targets)
        if mesh.is_last_stage:  # only the hidden states' gradient goes back: no cos/sin/mask
            assert engine.p2p.bytes_sent - sent == BATCH * SEQ * hidden * 4
        missing = [name for name, p in params.items() if p.grad is None]
        assert not missing, f"rank {mesh.rank} step {step}: no gradient for {missing}"
        comparisons = [refs.loss(step, loss_p)]
        comparisons += [refs.grad(step, name, p.grad) for name, p in params.items()]
        check(comparisons, f"rank {mesh.rank} step {step}: ")
        opt_s.step()
    return sorted(params)


def _covers_every_parameter(names_per_rank: list[list[str]], family: str, tie: bool) -> None:
    """Every HF parameter was checked on some stage (and names are the HF model's)."""
    every = {n for n, _ in hf_model(family, "eager", tie).named_parameters(remove_duplicate=False)}
    assert set().union(*map(set, names_per_rank)) == every


CASES = [
    # family, attention, world, tp, schedule, micro-batches, recompute
    ("llama", "sdpa", 2, 1, "gpipe", 4, False),
    ("llama", "eager", 2, 1, "1f1b", 3, True),
    ("llama", "sdpa", 4, 2, "1f1b", 2, False),
    ("llama", "eager", 4, 2, "gpipe", 3, True),
    ("qwen3", "eager", 2, 1, "1f1b", 4, False),
    ("qwen3", "sdpa", 2, 1, "gpipe", 2, True),
    ("qwen3", "sdpa", 4, 2, "1f1b", 2, False),  # per-head q_norm / k_norm under TP
    ("qwen3", "eager", 4, 2, "gpipe", 3, True),
]


@pytest.mark.parametrize("family, attn, world, tp, schedule, m, recompute", CASES)
def test_hf_pipeline_equals_unpipelined(family, attn, world, tp, schedule, m, recompute):
    refs = hf_references(family, attn)
    names = run_ranks(_pipelined, world, family, attn, tp, schedule, m, refs, recompute)
    _covers_every_parameter(names, family, tie=False)


@pytest.mark.parametrize(
    "family, attn, world, tp, schedule",
    [
        ("llama", "sdpa", 2, 1, "1f1b"),
        ("llama", "eager", 4, 2, "gpipe"),  # the copy keeps the vocab-parallel layout
        ("qwen3", "sdpa", 4, 1, "1f1b"),  # PP = 4: a middle stage holds neither end
    ],
)
def test_hf_tied_embeddings(family, attn, world, tp, schedule):
    refs = hf_references(family, attn, tie=True)
    names = run_ranks(_pipelined, world, family, attn, tp, schedule, 2, refs, tie=True)
    _covers_every_parameter(names, family, tie=True)
    assert "lm_head.weight" in names[-1] and "model.embed_tokens.weight" in names[0]


@pytest.mark.parametrize(
    "family, attn, schedule",
    [
        ("mistral", "eager", "1f1b"),
        ("qwen2", "sdpa", "gpipe"),
        ("mixtral", "sdpa", "1f1b"),
        ("qwen3_moe", "eager", "gpipe"),
    ],
)
def test_hf_other_families(family, attn, schedule):
    names = run_ranks(_pipelined, 2, family, attn, 1, schedule, 2, hf_references(family, attn))
    _covers_every_parameter(names, family, tie=False)


@pytest.mark.parametrize("family, attn", [("llama", "eager"), ("qwen2", "sdpa")])
def test_hf_padding_mask(family, attn):
    """(input_ids, attention_mask): the padding mask HF builds travels through the stages."""
    run_ranks(_pipelined, 2, family, attn, 1, "1f1b", 3, hf_references(family, attn, pad=2), pad=2)


def test_hf_blocks_match_the_model_exactly():
    """One process, no pipeline: the blocks in sequence give the HF model's logits bit for bit
    (eager and SDPA, with and without padding), and name every parameter as HF does."""
    ids, mask, _ = hf_batch(0, pad=2)
    for family in ("llama", "qwen2"):
        for attn in ("eager", "sdpa"):
            model = hf_model(family, attn)
            seq = nn.Sequential(*hf_decoder_blocks(model))
            for m in (None, mask):
                want = model(ids, attention_mask=m, use_cache=False).logits
                assert torch.equal(seq(ids if m is None else (ids, m)), want)
            assert dict(hf_named_parameters(seq)) == dict(model.named_parameters())
    blocks = hf_decoder_blocks(hf_model("qwen2", "eager"))
    assert [b.mask_slot for b in blocks[1:-1]] == [0, 1]  # a full, then a sliding layer


def test_hf_errors():
    model = hf_model("llama", "sdpa")
    del model.model.rotary_emb
    with pytest.raises(AttributeError, match=r"no attribute 'model.rotary_emb'"):
        hf_decoder_blocks(model)
    with pytest.raises(AttributeError, match=r"Linear cannot be .* no attribute 'config'"):
        hf_decoder_blocks(nn.Linear(2, 2))
    blocks = hf_decoder_blocks(hf_model("llama", "sdpa"))  # 2 layers: 4 blocks
    with pytest.raises(ValueError, match="the model has 4 blocks but the pipeline has 5 stages"):
        build_stage(blocks, 5, 0)
    gemma = transformers.GemmaConfig(**GQA)
    with pytest.raises(ValueError, match=r"model_type 'gemma'.*not a supported decoder family"):
        hf_decoder_blocks(transformers.AutoModelForCausalLM.from_config(gemma))
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        hf_decoder_blocks(hf_model("llama", "flex_attention"))
    with pytest.raises(ValueError, match="output_router_logits=True"):
        hf_decoder_blocks(hf_model("mixtral", "sdpa", output_router_logits=True))
    embed = blocks[0]
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(TypeError, match="inputs_embeds are not supported"):
        embed(torch.randn(2, SEQ, 4))
    with pytest.raises(ValueError, match="4D and custom masks are not carried"):
        embed((ids, torch.ones(2, 1, SEQ, SEQ)))
    with pytest.raises(TypeError, match=r"\(input_ids, attention_mask\), got 3 items"):
        embed((ids, ids, ids))


def _sdpa_padding_varies(static: bool) -> None:
    """SDPA builds no mask for a micro-batch without padding and one for a padded one: the
    message's mask slot changes — refused under static shapes, naming the fix; exact without."""
    mesh = make_mesh(pp=2)
    dense = hf_model("llama", "sdpa")
    stage, _ = build_stage(hf_decoder_blocks(copy.deepcopy(dense)), 2, mesh.pp_rank)
    ids, mask, targets = hf_batch(0, pad=1)
    mask[: BATCH // 2] = 1  # the first micro-batch is unpadded (its targets all count)
    targets[: BATCH // 2] = hf_batch(0)[2][: BATCH // 2]
    engine = PipelineEngine(stage, mesh, GPipe(2), loss_fn=loss_fn, static_shapes=static)
    loss_p = engine.train_step((ids, mask), targets)
    means = []
    for net in (dense, exact_copy(dense)):  # fp32, and the exact math (float64)
        halves = [
            loss_fn(net(i, attention_mask=a).logits, t)
            for i, a, t in zip(ids.chunk(2), mask.chunk(2), targets.chunk(2), strict=True)
        ]
        means.append((halves[0] + halves[1]).detach() / 2)
    assert torch.isfinite(means[1]), "the float64 loss is not finite"  # (an infinite bound)
    agree(loss_p, *means, "loss", length=max(VOCAB, BATCH * SEQ))


def test_hf_mask_that_varies_needs_dynamic_shapes():
    with pytest.raises(RankError, match=r"changed from .* None\) to .*pass static_shapes=False"):
        run_ranks(_sdpa_padding_varies, 2, True, timeout=60)
    run_ranks(_sdpa_padding_varies, 2, False)


def _tie_forgotten() -> None:
    stage = nn.Sequential(*hf_decoder_blocks(hf_model("llama", "sdpa", tie=True)))
    stage(torch.zeros(1, SEQ, dtype=torch.long))


def test_hf_tied_head_refuses_to_run_before_the_tie():
    with pytest.raises(RankError, match=r"call hf_tie_across_stages\(blocks, mesh\)"):
        run_ranks(_tie_forgotten, 1)
