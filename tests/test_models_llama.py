"""The fastpar Llama against its single-process self under tensor / sequence parallelism (initial
weights, logits, loss and every gradient on every rank, q/k-norm included), and its config's
checks (against Hugging Face's models: tests/test_models_llama_hf.py).

Two layouts of the same math round differently: none of this is bit for bit. Each quantity is
judged by ``fastpar.tolerance``'s rule against the single-process model in float64 (its norms,
RoPE, router and loss keep float64), with the fp32 model and its twin (every weight one ulp
away) as the measure of rounding (tests/_model_runs.py). Bit for bit only where nothing is
computed: the initial weights (each TP rank keeps its slice of the same draw)."""

from __future__ import annotations

import pytest
import torch
from _mesh import make_mesh
from _model_runs import agree_three, agree_tp_output, single_process
from _parity import local_part

from fastpar.checkpoint import import_state_dict
from fastpar.models import LlamaConfig, build_llama, llama_loss
from fastpar.testing import run_ranks


@pytest.mark.parametrize(
    "kwargs,tp,message",
    [
        (dict(heads=4, kv_heads=3), 1, "kv_heads 3 must divide heads 4"),
        (dict(heads=4, kv_heads=2), 4, "kv_heads 2 are not divisible by tp 4"),
        (dict(heads=6, hidden=48), 4, "heads 6 are not divisible by tp 4"),
        (dict(hidden=30, heads=4), 1, "hidden 30 is not divisible by heads 4: set head_dim"),
        (dict(hidden=32, heads=4, head_dim=7), 1, "head_dim 7 must be even"),
        (dict(ffn=50), 4, "ffn 50 is not divisible by tp 4"),
        (dict(rope_theta=0.0), 1, "rope_theta must be positive"),
        (dict(moe_every=1, num_experts=4, top_k=5), 1, r"top_k 5 must be in \[1, num_experts=4\]"),
        (dict(moe_every=-1), 1, "moe_every must be >= 0"),
        (dict(moe_every=2, moe_ffn=0), 1, "moe_ffn must be >= 1"),
    ],
)
def test_config_errors_name_the_value_and_the_fix(kwargs, tp, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs).check(tp=tp)


def test_default_ffn_is_swiglu_sized():
    # 8/3 of the width, rounded up to a multiple of 64: 8 * 64 / 3 = 170.7 -> 192
    assert LlamaConfig(hidden=64).ffn_size == 192
    assert LlamaConfig(hidden=96).ffn_size == 256


# -- tensor / sequence parallel: every rank against the single-process model -----------------
def _tp_parity(cfg: LlamaConfig, tp: int, initial, state, batch, want, length) -> None:
    mesh = make_mesh(tp=tp)
    torch.manual_seed(0)
    par = torch.nn.Sequential(*build_llama(cfg, mesh))
    params = dict(par.named_parameters())
    assert list(params) == list(initial)
    for name, p in params.items():  # every rank drew the full weights and kept its slice
        # bit for bit: a slice of the same draw, nothing computed
        assert torch.equal(p.detach(), local_part(initial[name], p)), f"initial {name}"
    import_state_dict(state, params)  # the moved norms and biases, by global name
    (ids, targets), ref_grads = batch, want[2]
    rank = mesh.tp_rank
    out = agree_tp_output(par(ids), targets, cfg, mesh, llama_loss, want, length, f"TP rank {rank}")
    out.backward()
    for name, p in params.items():
        assert p.grad is not None, f"no gradient for {name}"
        expect = [local_part(g[name], p) for g in ref_grads]
        agree_three(p.grad, expect, f"grad of {name} on TP rank {rank}", length)


TP_CASES = {
    "qknorm-gqa-tp2": (dict(qk_norm=True), 2),
    "qknorm-sp-tp2": (dict(qk_norm=True, sequence_parallel=True), 2),
    "bias-sp-untied-tp2": (dict(attention_bias=True, sequence_parallel=True), 2),
    "qknorm-moe-tp2": (dict(qk_norm=True, moe_every=2, moe_ffn=14), 2),  # experts over all TP
    "qknorm-bias-tied-tp4": (
        dict(qk_norm=True, attention_bias=True, tie_embeddings=True, heads=8, kv_heads=4),
        4,
    ),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_equals_single_process_on_every_rank(case):
    kwargs, tp = TP_CASES[case]
    base = dict(vocab_size=53, seq_len=8, hidden=24, heads=4, kv_heads=2, head_dim=6, ffn=20)
    cfg = LlamaConfig(layers=2, **{**base, **kwargs})
    run_ranks(_tp_parity, tp, cfg, tp, *single_process(cfg, build_llama, llama_loss))
