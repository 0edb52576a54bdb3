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
from _hf import GQA, VOCAB, transformers
from _mesh import make_mesh
from _parity import agree, exact_copy
from _pipeline_hf import (
    BATCH,
    SEQ,
    covers_every_parameter,
    hf_batch,
    hf_model,
    hf_references,
    loss_fn,
    pipelined,
)
from torch import nn

from fastpar.parallel.pipeline import GPipe, PipelineEngine, build_stage
from fastpar.parallel.pipeline.hf import (
    hf_decoder_blocks,
    hf_named_parameters,
)
from fastpar.testing import RankError, run_ranks

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
    names = run_ranks(pipelined, world, family, attn, tp, schedule, m, refs, recompute)
    covers_every_parameter(names, family, tie=False)


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
    names = run_ranks(pipelined, world, family, attn, tp, schedule, 2, refs, tie=True)
    covers_every_parameter(names, family, tie=True)
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
    names = run_ranks(pipelined, 2, family, attn, 1, schedule, 2, hf_references(family, attn))
    covers_every_parameter(names, family, tie=False)


@pytest.mark.parametrize("family, attn", [("llama", "eager"), ("qwen2", "sdpa")])
def test_hf_padding_mask(family, attn):
    """(input_ids, attention_mask): the padding mask HF builds travels through the stages."""
    run_ranks(pipelined, 2, family, attn, 1, "1f1b", 3, hf_references(family, attn, pad=2), pad=2)


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
