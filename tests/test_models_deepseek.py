"""The fastpar DeepSeek (multi-head latent attention + DeepSeekMoE) against its single-process
self under tensor / sequence parallelism (every parameter's gradient on every rank), with the
check shown to fail when the rotary key's TP region is removed; its config's checks;
``fastpar.verify --model deepseek`` (TP x DP x EP, and with PP and SP). Against Hugging Face's
``DeepseekV3ForCausalLM``: tests/test_models_deepseek_hf.py.

Judged as tests/test_models_llama.py judges the Llama (``fastpar.tolerance``'s rule): against
the single-process model in float64, with the fp32 model and its twin (every weight one ulp
away) as the measure of rounding (tests/_model_runs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _flags import DEEPSEEK, SIGMOID_GROUPS, tiny_config
from _mesh import make_mesh
from _model_runs import (
    agree_three,
    agree_tp_output,
    deepseek_moe,
    mla_sizes,
    single_process,
    yarn,
)
from _parity import local_part

from fastpar.checkpoint import import_state_dict
from fastpar.models import DeepSeekConfig, build_deepseek, deepseek_loss
from fastpar.models.llama import routed
from fastpar.testing import run_ranks


@pytest.mark.parametrize(
    "kwargs,tp,message",
    [
        (dict(heads=6), 4, "heads 6 are not divisible by tp 4"),
        (dict(qk_rope_head_dim=5), 1, "qk_rope_head_dim 5 must be even"),
        (dict(q_lora_rank=0), 1, "q_lora_rank must be >= 1, or None"),
        (dict(ffn=50, first_k_dense=1), 4, "ffn 50 of the dense blocks is not divisible by tp 4"),
        (dict(yarn_mscale_all_dim=1.0), 1, "the yarn_\\* options need YaRN on"),
        (dict(yarn_factor=-2.0), 1, "yarn_factor -2.0 must be a positive finite number"),
        (dict(first_k_dense=-1), 1, "first_k_dense must be >= 0"),
        (dict(first_k_dense=4, layers=4), 1, None),  # all dense: fine at ep 1
    ],
)
def test_config_errors_name_the_value_and_the_fix(kwargs, tp, message):
    cfg = routed(DeepSeekConfig, **kwargs)
    if message is None:
        cfg.check(tp=tp)
        with pytest.raises(ValueError, match=r"ep=2 needs MoE layers.*first_k_dense 4"):
            cfg.check(ep=2)
        return
    with pytest.raises(ValueError, match=message):
        cfg.check(tp=tp)


# -- tensor / sequence parallel: every rank against the single-process model -----------------
def _tp_mismatches(cfg, tp, initial, state, batch, want, length) -> list[str]:
    """Run the TP model on this rank: initial weights bit for bit and the logits and loss must
    agree (assert); returns the names of the parameters whose gradient does not."""
    mesh = make_mesh(tp=tp)
    torch.manual_seed(0)
    par = torch.nn.Sequential(*build_deepseek(cfg, mesh))
    params = dict(par.named_parameters())
    assert list(params) == list(initial)
    for name, p in params.items():
        assert torch.equal(p.detach(), local_part(initial[name], p)), f"initial {name}"
    with torch.no_grad():
        for name, b in par.named_buffers():
            if name in state:
                b.copy_(state[name])
    import_state_dict({k: v for k, v in state.items() if k in params}, params)
    (ids, targets), ref_grads = batch, want[2]
    where = f"TP rank {mesh.tp_rank}"
    out = agree_tp_output(par(ids), targets, cfg, mesh, deepseek_loss, want, length, where)
    out.backward()
    bad = []
    for name, p in params.items():
        assert p.grad is not None, f"no gradient for {name}"
        try:
            agree_three(p.grad, [local_part(g[name], p) for g in ref_grads], name, length)
        except AssertionError:
            bad.append(name)
    return bad


def _tp_parity(*args) -> None:
    bad = _tp_mismatches(*args)
    assert not bad, f"gradients that disagree on TP rank {dist.get_rank()}: {bad}"


def _tp_parity_without_the_k_pe_region(*args) -> list[str]:
    """The same with the rotary key's copy-to-region removed (identity both ways)."""
    import fastpar.models.mla as mla

    mla.copy_to_region = lambda x, group=None: x  # this forked rank only
    return _tp_mismatches(*args)


BASE = dict(
    vocab_size=53,
    seq_len=8,
    hidden=24,
    heads=4,
    ffn=20,
    layers=2,
    **mla_sizes(10, 8, 4, 6, 5),
    **deepseek_moe(1, 4, 2, 6),
    **SIGMOID_GROUPS,
    shared_expert_ffn=8,
    routed_scaling_factor=2.0,
    aux_loss="sequence",
    **yarn(2.0, 4, 1.0),
)
TP_CASES = {
    "qlora-tp2": (dict(), 2),
    "qlora-sp-tp2": (dict(sequence_parallel=True), 2),
    "noq-halves-tied-tp2": (dict(q_lora_rank=None, rope_interleave=False, tie_embeddings=True), 2),
    "qlora-tp4": (dict(), 4),
    "noq-sp-tp4": (dict(q_lora_rank=None, sequence_parallel=True), 4),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_equals_single_process_on_every_rank(case):
    kwargs, tp = TP_CASES[case]
    cfg = routed(DeepSeekConfig, **{**BASE, **kwargs})
    run_ranks(
        _tp_parity, tp, cfg, tp, *single_process(cfg, build_deepseek, deepseek_loss, buffers=True)
    )


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "sp-tp2"])
def test_without_the_rotary_key_region_the_gradients_disagree(sp):
    """k_pe (one activation broadcast into every local head) without its copy-to-region:
    logits and loss still agree, but each rank's kv_a (the replicated down projection holding
    k_pe's rows) gets only its own heads' gradient — the check must name it on every rank."""
    cfg = routed(DeepSeekConfig, **{**BASE, "sequence_parallel": sp})
    results = run_ranks(
        _tp_parity_without_the_k_pe_region,
        2,
        cfg,
        2,
        *single_process(cfg, build_deepseek, deepseek_loss, buffers=True),
    )
    for bad in results:
        assert any(name.endswith("attn.kv_a.weight") for name in bad), bad


# -- the trainer and fastpar.verify -------------------------------------------------------------
SMALL = tiny_config(steps=3, layers=3)


@pytest.mark.parametrize(
    "layout",
    [
        # (tests/test_models_deepseek_parallel.py runs tp2 x pp2 x dp2 x ep2 with MTP in the CPU tier)
        pytest.param(dict(tp=2, dp=2, ep=2, pp=1, zero=1), marks=pytest.mark.slow),
        pytest.param(
            dict(tp=2, dp=2, ep=2, pp=2, zero=1, sequence_parallel=True), marks=pytest.mark.slow
        ),
    ],
    ids=["tp2-dp2-ep2-z1", "tp2-pp2-dp2-ep2-sp-z1"],
)
def test_verify_deepseek_agrees(layout):
    """``fastpar.verify --model deepseek``: the trainer's run equals the single-process model
    (losses, grad norms, every parameter and expert bias after 3 steps)."""
    from fastpar.train import TrainConfig
    from fastpar.verify import compare

    cfg = TrainConfig.from_flags(model_type="deepseek", **SMALL, **DEEPSEEK, **layout)
    assert cfg.model.moe_every == 1 and cfg.model.is_moe(1) and not cfg.model.is_moe(0)
    ok, text = compare(cfg)
    assert ok, text
    assert text.endswith("AGREE")


def test_trainer_flags_of_the_other_models_are_refused():
    from fastpar.train import TrainConfig

    for kwargs, message in [
        (dict(model_type="llama", kv_lora_rank=16), "--kv-lora-rank is a DeepSeek option"),
        (dict(model_type="gpt", yarn_factor=2.0), "--yarn-factor is a DeepSeek option"),
        (dict(model_type="deepseek", kv_heads=2), "--kv-heads is a Llama option"),
        (
            dict(model_type="deepseek", cp=2, cp_attention="all-to-all", heads=2),
            "--cp-attention all-to-all scatters this rank's 1 query heads",
        ),
        (dict(model_type="deepseek", heads=3), "heads 3 are not divisible by tp 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_flags(
                **{**SMALL, "tp": 2, "pp": 1, "dp": 2, "ep": 2, **kwargs}
            ).check()
