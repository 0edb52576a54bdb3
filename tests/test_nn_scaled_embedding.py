"""Hugging Face's scaled word embedding (Gemma 3's ``embed_tokens``: the lookup times
``embed_scale``) split over the vocabulary by a user's plan: ``VocabParallelEmbedding`` keeps the
scale, applied after the lookup in the weight's dtype as HF does. Gemma 3 (random init, a small
config) under a plan at TP 2 and 4: logits, loss and every gradient on every rank agree with the
unsplit model by ``fastpar.tolerance``'s rule; replicated gradients equal across the TP group;
without the scale the logits do not agree (the test can fail)."""

from __future__ import annotations

import copy

import pytest
import torch
from _hf import DECODER, VOCAB, agree_grads, agree_runs, dense_runs, transformers
from _mesh import make_mesh

from fastpar import parallelize
from fastpar.nn import VocabParallelEmbedding
from fastpar.parity import reduction_length
from fastpar.testing import RankError, run_ranks

PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.self_attn.q_norm": "per_head",
    "model.layers.*.self_attn.k_norm": "per_head",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
    "lm_head": ("column", {"gather_output": True, "pad_output": True}),
}


def _gemma3():
    config = transformers.Gemma3TextConfig(**DECODER, sliding_window=8)
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).float()


def _batch():
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(100))
    return ids, ids


def _one_step(tp: int, unscaled: bool = False) -> int:
    dense = _gemma3()
    scale = float(torch.tensor(32**0.5))  # sqrt(hidden) in fp32: far from 1
    assert float(dense.model.embed_tokens.embed_scale) == scale
    par, mesh = copy.deepcopy(dense), make_mesh(tp=tp)
    parallelize(par, PLAN, mesh=mesh)
    emb = par.model.embed_tokens
    assert isinstance(emb, VocabParallelEmbedding) and float(emb.embed_scale) == scale
    if unscaled:  # what a split that drops the scale computes
        emb.embed_scale = None
    ids, labels = _batch()
    n = reduction_length(dense, ids)
    runs = dense_runs("gemma3", dense, ids, labels)
    out = par(input_ids=ids, labels=labels)
    agree_runs(out.logits, runs, lambda r: r[0], "logits", n)
    out.loss.backward()
    return agree_grads(par, runs, n, mesh.tp_group)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gemma3_scaled_embedding_splits_over_the_vocabulary(tp):
    counts = run_ranks(_one_step, tp, tp)
    assert counts[0] == len(dict(_gemma3().named_parameters(remove_duplicate=False)))


def test_without_the_scale_the_logits_disagree():
    with pytest.raises(RankError, match="logits"):
        run_ranks(_one_step, 2, 2, True)
