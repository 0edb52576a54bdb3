"""The GPT and Llama-class models under context parallelism, one forward and backward, against
the single-process model on the same batch: the loss, and every parameter's gradient on every
rank — each cp rank's gradient is its tokens' share of the sequence's mean loss, so the mean
over the cp group (what data parallelism over dp × cp takes) must equal the single-process
gradient; TP-sharded parameters against their slice, and copies held by several ranks (norms,
routers, replicated experts) must agree after that mean. Covers cp 2 and 4, cp × TP with and
without SP, GQA, MoE blocks (aux loss and z-loss: their gradient is weighted × cp) and the
all-to-all attention.

Not bit for bit: ring attention merges its blocks with an online softmax and the cp ranks'
gradients are summed by an all-reduce, in another order than the single process's sums. Each
quantity is judged by ``fastpar.tolerance``'s rule: against the single-process model in float64
(plain attention), with the fp32 model and its twin (weights one ulp away) as the measure of
rounding."""

from __future__ import annotations

import pytest
from _context import cp_step, references

from fastpar.testing import run_ranks

CASES = {
    "gpt-cp2": ("gpt", dict(cp=2), {}),
    "llama-gqa-cp4": ("llama", dict(cp=4), dict(kv_heads=2)),
    "llama-cp2-tp2": ("llama", dict(cp=2, tp=2), dict(kv_heads=2)),
    "gpt-cp2-tp2-sp": ("gpt", dict(cp=2, tp=2), dict(sequence_parallel=True)),
    "llama-cp2-moe": ("llama", dict(cp=2), dict(moe_every=2, z_loss_coef=0.1, aux_loss_coef=0.3)),
    "llama-cp2-tp2-sp-moe": (
        "llama",
        dict(cp=2, tp=2),
        dict(moe_every=2, sequence_parallel=True, aux_loss="sequence"),
    ),
    "llama-cp2-a2a": ("llama", dict(cp=2), dict(kv_heads=2, cp_attention="all-to-all")),
    # ignored targets that fall unevenly on the cp ranks: the loss is still the sequence's mean
    "gpt-cp2-ignored": ("gpt", dict(cp=2), dict(ignored=5)),
    "llama-cp4-tp2-ignored": ("llama", dict(cp=4, tp=2), dict(ignored=3, kv_heads=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_gradient_on_every_rank_equals_the_single_process_model(name):
    kind, layout, extra = CASES[name]
    world = layout["cp"] * layout.get("tp", 1)
    counts = run_ranks(cp_step, world, kind, layout, extra, None, *references(kind, extra))
    assert len(set(counts)) == 1 and counts[0] > 0
