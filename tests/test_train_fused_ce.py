"""``--fused-ce``: the trainer's loss as the vocab-parallel fused linear cross-entropy (the
head hands over its hidden states; logits exist a chunk of tokens at a time). The single
process gives the same losses and parameters as the unfused loss; ``fastpar.verify`` agrees
at TP x DP, TP x PP with SP and bf16 under CP (GPipe, whose backward recomputes the chunks:
tests/test_verify_matrix.py)."""

from __future__ import annotations

import dataclasses

import pytest
from _flags import tiny_config

from fastpar.train import TrainConfig, load_data
from fastpar.verify import compare, reference, references

SMALL = tiny_config(steps=3)
LAYOUTS = {
    "llama-tp2-pp2-sp": dict(
        model_type="llama", tp=2, pp=2, dp=1, ep=1, zero=1, moe_every=0, sequence_parallel=True
    ),
    "llama-tp2-cp2-bf16": dict(
        model_type="llama", tp=2, pp=1, dp=1, ep=1, zero=1, moe_every=0, precision="bf16", cp=2
    ),
    "llama-moe-ep2-untied": dict(
        model_type="llama", tp=1, pp=1, dp=2, ep=2, zero=1, moe_every=2, untied=True
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verify_with_the_fused_loss(name):
    ok, text = compare(TrainConfig.from_flags(**{**SMALL, **LAYOUTS[name], "fused_ce": True}))
    assert ok, text


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_fused_loss_trains_like_the_unfused_one(model):
    cfg = TrainConfig.from_flags(
        **{
            **SMALL,
            "model_type": model,
            "tp": 1,
            "pp": 1,
            "dp": 2,
            "ep": 1,
            "moe_every": 0,
            "fused_ce": True,
        }
    )
    tokens = load_data(cfg)
    fused = reference(cfg, tokens)
    # the unfused loss on one process (it, its twin, float64): the rule of fastpar.tolerance
    refs = references(dataclasses.replace(cfg, fused_ce=False), tokens)
    for step, loss in enumerate(fused.losses):
        assert refs.loss(step, loss).ok, refs.loss(step, loss)
    assert fused.params.keys() == refs.exact.params.keys()
    for name, p in fused.params.items():
        c = refs.param(name, p)  # AdamW's slack for rounding-level gradients included
        assert c.ok, c


def test_fused_loss_refusals():
    with pytest.raises(ValueError, match="--fused-ce with --zero 3"):
        TrainConfig.from_flags(**{**SMALL, "fused_ce": True, "zero": 3, "moe_every": 0}).check()
