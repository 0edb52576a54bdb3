"""Hugging Face decoders split by layer (``hf_decoder_blocks``) against the unpipelined model:
the small models (``hf_model``: tests/_hf.py's, untied unless asked, sliding windows shorter
than ``SEQ``), their batches (``hf_batch``, left padding optional) and loss, the references
(``hf_references``: two SGD steps, fp32, its twin, float64), a rank's pipelined run judged
against them (``pipelined``) and the check that every parameter was judged on some stage
(``covers_every_parameter``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _hf import VOCAB, build
from _mesh import make_mesh
from _training import check, references, sliced
from torch import nn

from fastpar import parallelize
from fastpar.parallel.pipeline import GPipe, OneFOneB, PipelineEngine, build_stage
from fastpar.parallel.pipeline.hf import (
    hf_decoder_blocks,
    hf_named_parameters,
    hf_tie_across_stages,
)

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


def pipelined(
    family: str,
    attn: str,
    tp: int,
    schedule: str,
    m: int,
    refs,
    recompute: bool = False,
    tie: bool = False,
    pad: int = 0,
    plan: dict | None = PLAN,
) -> list[str]:
    """On this rank: two SGD steps of ``family``'s model split by layer over the pipeline
    (TP ``tp`` by ``plan``, None: the family's built-in plan), each step's loss and every
    gradient judged against ``refs``; returns the names of the parameters checked."""
    mesh = make_mesh(tp=tp, pp=torch.distributed.get_world_size() // tp)
    model = hf_model(family, attn, tie)
    hidden = model.config.hidden_size
    if tp > 1:
        parallelize(model, plan, mesh=mesh)
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


def covers_every_parameter(names_per_rank: list[list[str]], family: str, tie: bool) -> None:
    """Every HF parameter was checked on some stage (and names are the HF model's)."""
    every = {n for n, _ in hf_model(family, "eager", tie).named_parameters(remove_duplicate=False)}
    assert set().union(*map(set, names_per_rank)) == every
