"""Context parallelism through the trainer: ``fastpar.verify`` (losses, grad norms and every
parameter after 3 steps against the single-process model) at cp2 × tp2 × dp2 with ZeRO-1, for
the GPT and the Llama-class model, composed with SP, EP (MoE), ZeRO-2/3, ZB-H1 and cp 4 (cp 2
with pp 2, interleaved too: tests/test_verify_matrix.py); the layout refusals name the value
and the fix."""

from __future__ import annotations

import pytest
from _flags import tiny_config
from _parity import NO_INDUCTOR

from fastpar.train import TrainConfig
from fastpar.verify import compare

SMALL = tiny_config(steps=3)


def _cp(model_type: str, cp=2, tp=1, pp=1, dp=1, ep=1, zero=1, moe_every=0, **more) -> dict:
    """A layout of ``model_type``: cp 2, no other parallelism, ZeRO-1, no MoE block, but for
    what is given; ``more``: flags beside the layout."""
    layout = dict(cp=cp, tp=tp, pp=pp, dp=dp, ep=ep, zero=zero, moe_every=moe_every)
    return dict(model_type=model_type, **layout, **more)


LAYOUTS = {
    "llama-cp2-dp2-moe-ep2-z1": _cp("llama", dp=2, ep=2, moe_every=2),
    "llama-cp2-dp2-z3": _cp("llama", dp=2, zero=3),
    "llama-cp4": _cp("llama", cp=4),
    "llama-cp2-tp2-a2a": _cp("llama", tp=2, heads=8, kv_heads=2, cp_attention="all-to-all"),
    "gpt-cp2-recompute-attention": _cp("gpt", recompute="attention"),
    "gpt-cp2-compile": _cp("gpt", compile=True, steps=2),
    "gpt-cp2-dp2-a2a-z2": _cp("gpt", dp=2, zero=2, cp_attention="all-to-all"),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[NO_INDUCTOR, pytest.mark.slow]) if "compile" in n else n
        for n in LAYOUTS
    ],
)
def test_verify_under_context_parallelism(name):
    ok, text = compare(TrainConfig.from_flags(**{**SMALL, **LAYOUTS[name]}))
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
    cfg = TrainConfig.from_flags(
        **{**SMALL, "pp": 1, "dp": 1, "ep": 1, "tp": 1, "moe_every": 0, **flags}
    )
    with pytest.raises(ValueError, match=match):
        cfg.check()
