"""The fastpar Llama against Hugging Face's own models (LlamaForCausalLM, Qwen3ForCausalLM,
Qwen2ForCausalLM, and with MoE blocks Qwen3MoeForCausalLM and MixtralForCausalLM): logits, loss
and every gradient, weights mapped both ways (``fastpar.models.llama_hf``), HF's weights in a
tensor-parallel model, export_hf -> from_pretrained, from a checkpoint trained at dp x tp x pp
x ep too; what has no HF family is refused.

Two implementations of the same math round differently: none of these is bit for bit. Each
quantity is judged by ``fastpar.tolerance``'s rule against fastpar's single-process model in
float64 (HF's cast RMSNorm and RoPE to fp32, so HF in float64 is no exact reference), with the
fp32 model and its twin (every weight one ulp away) as the measure of rounding
(tests/_model_runs.py): HF's fp32 run is the one judged. A defect in either implementation's
math puts it far from fastpar's float64 run, while fastpar's own fp32 run stays within rounding
of it. Bit for bit only where nothing is computed: the name mapping."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _flags import tiny_config
from _mesh import make_mesh
from _model_runs import (
    against_hf,
    agree_three,
    check_from_hf,
    check_mapping_refusals,
    hf_model,
    logits_of,
    perturb_,
    three,
)

from fastpar.checkpoint import export_hf, import_state_dict
from fastpar.comm import gather_from_region
from fastpar.models import LlamaConfig, build_llama, from_hf, hf_config, llama_loss, to_hf
from fastpar.models.llama import routed
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks


def _sizes(vocab: int, hidden: int, heads: int, kv_heads: int, head_dim=None, ffn=None) -> dict:
    """A variant's sizes as ``LlamaConfig`` keywords (``head_dim``, ``ffn``: None, the default)."""
    sizes = dict(vocab_size=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads)
    return {**sizes, **{k: v for k, v in dict(head_dim=head_dim, ffn=ffn).items() if v is not None}}


def _moe(every: int, experts: int, top_k: int, ffn: int) -> dict:
    """A variant's MoE blocks as ``LlamaConfig`` keywords."""
    return dict(moe_every=every, num_experts=experts, top_k=top_k, moe_ffn=ffn)


# odd sizes everywhere: vocab not a multiple of TP, head_dim != hidden / heads, ffn odd
VARIANTS = {  # _sizes(vocab, hidden, heads, kv_heads, head_dim, ffn)
    "llama-gqa-untied": dict(_sizes(101, 40, 4, 2, 12, 58), rope_theta=5e5, norm_eps=1e-5),
    "qwen3-qknorm-tied": dict(
        _sizes(97, 36, 6, 2, ffn=50), qk_norm=True, tie_embeddings=True, rope_theta=1e6
    ),
    "qwen2-bias-mqa": dict(_sizes(89, 48, 4, 1, 10, 70), attention_bias=True),
    # MoE: layer 1 of 2 sparse (decoder_sparse_step 2), expert width != dense width
    "qwen3moe-every2-gqa": dict(
        _sizes(83, 36, 6, 2, ffn=50), qk_norm=True, **_moe(2, 4, 2, 22), rope_theta=1e6
    ),
    "qwen3moe-raw-top3-tied": dict(
        _sizes(79, 32, 4, 1, 10, 40),
        qk_norm=True,
        **_moe(1, 6, 3, 18),
        norm_topk_prob=False,
        tie_embeddings=True,
    ),
    "mixtral-gqa": dict(_sizes(91, 40, 4, 2, 12), **_moe(1, 4, 2, 26), norm_eps=1e-5),
}
HF_TYPE = {
    "llama-gqa-untied": "llama",
    "qwen3-qknorm-tied": "qwen3",
    "qwen2-bias-mqa": "qwen2",
    "qwen3moe-every2-gqa": "qwen3_moe",
    "qwen3moe-raw-top3-tied": "qwen3_moe",
    "mixtral-gqa": "mixtral",
}


def _fastpar_model(cfg: LlamaConfig, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*build_llama(cfg))
    perturb_(model, seed + 1)
    return model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_every_gradient_equal_hf(name):
    cfg = LlamaConfig(layers=2, seq_len=16, **VARIANTS[name])
    ours = _fastpar_model(cfg)
    config = hf_config(cfg)
    assert config["model_type"] == HF_TYPE[name]
    hf = hf_model(config)
    assert type(hf).__name__ == config["architectures"][0]
    state = {k: v.detach().clone() for k, v in ours.named_parameters()}
    hf.load_state_dict(to_hf(state, cfg), strict=True)
    if cfg.tie_embeddings:  # HF re-ties after load: one tensor, no stray copy
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    map_grads = lambda g: to_hf(g, cfg)  # noqa: E731
    grads, hf_params, length = against_hf(ours, hf, cfg, llama_loss, map_grads)
    assert set(grads[0]) == set(hf_params)
    for k in grads[0]:
        agree_three(hf_params[k].grad, [g[k] for g in grads], f"HF's gradient of {k}", length)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_hf_loads_an_hf_model(name):
    cfg = LlamaConfig(layers=2, seq_len=16, **VARIANTS[name])
    check_from_hf(cfg, build_llama, from_hf, hf_config, to_hf)


@pytest.mark.parametrize("name", ["qwen3-qknorm-tied", "llama-gqa-untied"])
def test_export_hf_loads_with_from_pretrained(name, tmp_path):
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    cfg = LlamaConfig(layers=2, seq_len=16, **VARIANTS[name])
    ours = _fastpar_model(cfg)
    state = {k: v.detach() for k, v in ours.named_parameters()}
    export_hf(to_hf(state, cfg), tmp_path, hf_config(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    runs = logits_of(three(ours), ids, (2, 9, -1))
    with torch.no_grad():
        agree_three(hf(ids).logits, runs, "from_pretrained's logits", reduction_length(ours, ids))


def test_hf_mapping_refuses_what_it_cannot_map():
    refused = {
        r"capacity_factor=1.25 has no HF export: HF's MoE models .* drop no tokens": dict(
            qk_norm=True, moe_every=2, capacity_factor=1.25
        ),
        r"moe_every=2 without qk_norm has no HF family: Mixtral has a MoE in every block; use "
        r"moe_every=1 \(Mixtral\) or qk_norm=True": dict(moe_every=2),
        "MoE blocks with attention_bias have no HF family": dict(moe_every=1, attention_bias=True),
        "norm_topk_prob=False without qk_norm has no HF family: Mixtral always": dict(
            moe_every=1, norm_topk_prob=False
        ),
        "qk_norm with attention_bias has no HF family": dict(qk_norm=True, attention_bias=True),
    }
    for message, kwargs in refused.items():
        with pytest.raises(ValueError, match=message):
            hf_config(LlamaConfig(**kwargs))
        with pytest.raises(ValueError, match=message):
            to_hf({}, LlamaConfig(**kwargs))
    cfg = LlamaConfig(layers=1, seq_len=8, hidden=16, heads=2, vocab_size=11)
    torch.manual_seed(0)
    state = {k: v.detach() for k, v in torch.nn.Sequential(*build_llama(cfg)).named_parameters()}
    with pytest.raises(ValueError, match=r"1.attn.qkv.weight: shape \(48, 16\), expected"):
        to_hf(state, dataclasses.replace(cfg, kv_heads=1))
    bad = {
        "mlp_bias=True is not supported": {"mlp_bias": True},
        "attention_bias=True is not supported: fastpar has no o_proj bias": {
            "attention_bias": True
        },
        "hidden_act='gelu' is not supported": {"hidden_act": "gelu"},
        "model_type 'gpt2' is not one of": {"model_type": "gpt2"},
    }
    hf_state, config = check_mapping_refusals(state, cfg, to_hf, hf_config, from_hf, bad)
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        from_hf(hf_state, {**config, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"1 tensors have no fastpar name.*mlp.gate_proj.bias"):
        from_hf({**hf_state, "model.layers.0.mlp.gate_proj.bias": torch.zeros(1)}, config)
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        from_hf({k: v for k, v in hf_state.items() if k != "model.norm.weight"}, config)
    hf_moe = {}
    for qk_norm in (True, False):  # Qwen3-MoE, Mixtral: each maps back to its own config
        experts = dict(moe_every=1, num_experts=2, top_k=1, moe_ffn=4, ffn=4)
        moe = dataclasses.replace(cfg, qk_norm=qk_norm, **experts, kv_heads=2, head_dim=8)
        torch.manual_seed(0)
        weights = {
            k: v.detach() for k, v in torch.nn.Sequential(*build_llama(moe)).named_parameters()
        }
        hf_moe[qk_norm] = to_hf(weights, moe), hf_config(moe)
        assert from_hf(*hf_moe[qk_norm])[0] == moe
    (qwen3_moe, qwen3_moe_config), (mixtral, mixtral_config) = hf_moe[True], hf_moe[False]
    bad_moe = {
        r"mlp_only_layers=\[0\] is not supported: fastpar's Llama places its MoE blocks by "
        "decoder_sparse_step": (qwen3_moe, {**qwen3_moe_config, "mlp_only_layers": [0]}),
        "router_jitter_noise=0.1 is not supported": (
            mixtral,
            {**mixtral_config, "router_jitter_noise": 0.1},
        ),
        "sliding_window=8 is not supported": (mixtral, {**mixtral_config, "sliding_window": 8}),
    }
    for message, (weights, config_dict) in bad_moe.items():
        with pytest.raises(ValueError, match=message):
            from_hf(weights, config_dict)


def _hf_weights_at_tp(cfg_dict, hf_state, ids, runs, length, tp):
    mesh = make_mesh(tp=tp)
    cfg, state = from_hf(hf_state, cfg_dict)
    par = torch.nn.Sequential(*build_llama(cfg, mesh))
    import_state_dict(state, dict(par.named_parameters()))
    with torch.no_grad():
        full = gather_from_region(par(ids), mesh.tp_group, dim=-1)
    got = full[:, : cfg.vocab_size].view(runs[0].shape)
    agree_three(got, runs, f"TP logits on rank {mesh.tp_rank}", length)


def test_hf_weights_load_into_a_tensor_parallel_model():
    """HF's weights in a TP = 2 fastpar model: its logits and HF's own, each against the
    single-process fastpar model holding them (fp32, twin, float64)."""
    cfg = LlamaConfig(layers=2, seq_len=12, **VARIANTS["qwen3-qknorm-tied"])
    torch.manual_seed(2)
    hf = hf_model(hf_config(cfg))
    perturb_(hf, 3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        want = hf(ids).logits
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    got_cfg, ours_state = from_hf(state, hf.config.to_dict())
    single = torch.nn.Sequential(*build_llama(got_cfg))
    single.load_state_dict(ours_state, strict=True)
    runs = logits_of(three(single), ids, want.shape)
    length = reduction_length(single, ids)
    agree_three(want, runs, "HF's logits", length)
    run_ranks(_hf_weights_at_tp, 2, hf.config.to_dict(), state, ids, runs, length, 2)


TRAINED = {  # (TrainConfig options, the HF class from_pretrained must build)
    "qwen3-moe": (dict(qk_norm=True, moe_every=2, ep=2), "Qwen3MoeForCausalLM"),
    "mixtral": (dict(moe_every=1, ep=2, untied=True), "MixtralForCausalLM"),
    "qwen3-dense": (dict(qk_norm=True, moe_every=0, ep=1), "Qwen3ForCausalLM"),
}


@pytest.mark.parametrize("family", list(TRAINED))
def test_a_checkpoint_trained_at_dp_tp_pp_ep_exports_to_hf(family, tmp_path):
    """Trained at dp 2 x tp 2 x pp 2 (x ep 2: MoE experts split over EP; the tied embedding's
    copy on the last stage), exported, written as an HF directory and loaded by transformers'
    from_pretrained (its default experts implementation): the same logits as the
    single-process fastpar model holding the checkpoint's weights."""
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    from fastpar.checkpoint import export_state_dict
    from fastpar.train import TrainConfig, launch

    options, arch = TRAINED[family]
    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig.from_flags(
        **tiny_config(model_type="llama", tp=2, pp=2, dp=2, kv_heads=2, ffn=48, **options),
        checkpoint_dir=str(ckpt),
        save_every=2,
    )
    launch(cfg)
    state = export_state_dict(ckpt / "step_000002")
    model_cfg = cfg.model
    if model_cfg.tie_embeddings:  # the last stage's copy is saved as the embedding itself
        assert f"{model_cfg.layers + 1}.weight" not in state and "0.tok.weight" in state
    export_hf(to_hf(state, model_cfg), tmp_path / "hf", hf_config(model_cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    )
    assert type(hf).__name__ == arch
    ours = torch.nn.Sequential(*build_llama(model_cfg))
    import_state_dict(state, dict(ours.named_parameters()))  # every parameter (tied: once)
    ids = torch.randint(
        0, model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    runs = logits_of(three(ours), ids, (2, 16, -1))
    with torch.no_grad():
        agree_three(hf(ids).logits, runs, "from_pretrained's logits", reduction_length(ours, ids))


@pytest.mark.parametrize(
    "routing",
    [
        dict(router_score="sigmoid"),
        dict(expert_bias=True),
        dict(shared_expert_ffn=8),
        dict(router_groups=2, router_group_topk=1),
        dict(routed_scaling_factor=2.0),
    ],
)
def test_deepseek_style_routing_has_no_hf_export(routing):
    """Qwen3-MoE / Mixtral route by a plain softmax top-k: exporting another routing under
    their names would load as a model computing another function."""
    cfg = routed(LlamaConfig, layers=2, seq_len=16, moe_every=1, num_experts=4, **routing)
    with pytest.raises(ValueError, match="DeepSeek-style routing or shared experts"):
        hf_config(cfg)
