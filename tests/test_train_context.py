"""Context parallelism through the trainer: ``fastpar.verify`` (losses, grad norms and every
parameter after 3 steps against the single-process model) at cp2 × tp2 × dp2 with ZeRO-1, for
the GPT and the Llama-class model, composed with SP, EP (MoE), ZeRO-2/3, ZB-H1 and cp 4 (cp 2
with pp 2, interleaved too: tests/test_verify_matrix.py); the layout refusals name the value
and the fix."""

from __future__ import annotations

import pytest
from _parity import NO_INDUCTOR

from fastpar.train import TrainConfig
from fastpar.verify import compare

SMALL = dict(steps=3, batch_size=8, seq_len=16, hidden=32, heads=4, layers=2, quiet=True)
LAYOUTS = {
    "llama-cp2-dp2-moe-ep2-z1": dict(
        model_type="llama", cp=2, tp=1, pp=1, dp=2, ep=2, zero=1, moe_every=2
    ),
    "llama-cp2-dp2-z3": dict(model_type="llama", cp=2, tp=1, pp=1, dp=2, ep=1, zero=3, moe_every=0),
    "llama-cp4": dict(model_type="llama", cp=4, tp=1, pp=1, dp=1, ep=1, zero=1, moe_every=0),
    "llama-cp2-tp2-a2a": dict(
        model_type="llama",
        cp=2,
        tp=2,
        pp=1,
        dp=1,
        ep=1,
        zero=1,
        moe_every=0,
        heads=8,
        kv_heads=2,
        cp_attention="all-to-all",
    ),
    "gpt-cp2-recompute-attention": dict(
        model_type="gpt", cp=2, tp=1, pp=1, dp=1, ep=1, zero=1, moe_every=0, recompute="attention"
    ),
    "gpt-cp2-compile": dict(
        model_type="gpt", cp=2, tp=1, pp=1, dp=1, ep=1, zero=1, moe_every=0, compile=True, steps=2
    ),
    "gpt-cp2-dp2-a2a-z2": dict(
        model_type="gpt",
        cp=2,
        tp=1,
        pp=1,
        dp=2,
        ep=1,
        zero=2,
        moe_every=0,
        cp_attention="all-to-all",
    ),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[NO_INDUCTOR, pytest.mark.slow]) if "compile" in n else n
        for n in LAYOUTS
    ],
)
def test_verify_under_context_parallelism(name):
    ok, text = compare(TrainConfig(**{**SMALL, **LAYOUTS[name]}))
    assert ok, text


@pytest.mark.parametrize(
    "flags,match",
    [
        (dict(cp=2, seq_len=14), r"--seq-len 14 is not divisible by 4"),
        (
            dict(cp=2, tp=4, seq_len=12, sequence_parallel=True),
            r"this rank's 6 tokens do not split over tp 4",
        ),
        (dict(cp=2, capacity_factor=1.25, moe_every=2), r"--capacity-factor 1.25"),
        (dict(cp=4, heads=2, cp_attention="all-to-all"), r"this rank's 2 query heads"),
    ],
)
def test_context_parallel_refusals(flags, match):
    cfg = TrainConfig(**{**SMALL, "pp": 1, "dp": 1, "ep": 1, "tp": 1, "moe_every": 0, **flags})
    with pytest.raises(ValueError, match=match):
        cfg.check()
