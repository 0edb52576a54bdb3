"""The fastpar DeepSeek (multi-head latent attention + DeepSeekMoE) against Hugging Face's
``DeepseekV3ForCausalLM``: logits, loss and every gradient, the weights mapped both ways
(``fastpar.models.deepseek_hf``), low-rank query on and off, YaRN on; HF's weights at TP 2 x
EP 2; a checkpoint trained at dp x tp x pp x ep exported and loaded by from_pretrained; what HF
does not compute refused. Multi-token prediction: the MTP weights under DeepSeek-V3's HF names
both ways (bit for bit), a checkpoint with MTP exported for ``from_pretrained`` (its logits
fastpar's, the MTP tensors beside its own), and the exported MTP tensors in transformers' own
``MtpLayer`` (its MTP drafter's layer) giving fastpar's depth-1 logits.

Judged as tests/test_models_llama_hf.py judges the Llama (``fastpar.tolerance``'s rule):
against fastpar's single-process model in float64, with the fp32 model and its twin (every
weight one ulp away) as the measure of rounding (tests/_model_runs.py); HF's fp32 run is the
one judged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _flags import DEEPSEEK, tiny_config
from _mesh import make_mesh
from _model_runs import (
    against_hf,
    agree_three,
    agree_tp_output,
    check_from_hf,
    check_mapping_refusals,
    deepseek_moe,
    hf_model,
    mla_sizes,
    perturb_,
    three,
    three_runs,
    without_aux_loss,
    yarn,
)

from fastpar.checkpoint import import_state_dict
from fastpar.models import DeepSeekConfig, build_deepseek, deepseek_loss
from fastpar.models.deepseek_hf import from_hf, hf_config, is_mtp_name, to_hf
from fastpar.models.llama import routed
from fastpar.moe.layer import aux_loss_scale
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks

ROUTING = dict(router_score="sigmoid", expert_bias=True, aux_loss="none")


def _sizes(vocab: int, hidden: int, heads: int, ffn: int) -> dict:
    """A variant's sizes as ``DeepSeekConfig`` keywords."""
    return dict(vocab_size=vocab, hidden=hidden, heads=heads, ffn=ffn)


# odd sizes: v_head_dim != q/k head dim, rope != nope, vocab not a multiple of TP
VARIANTS = {
    "qlora-yarn-interleaved-groups-shared": dict(
        _sizes(61, 32, 4, 40),
        **mla_sizes(12, 10, 4, 6, 5),
        **deepseek_moe(1, 4, 2, 8),
        router_groups=2,
        router_group_topk=1,
        shared_expert_ffn=16,
        routed_scaling_factor=2.5,
        **yarn(2.0, 8, 1.0, yarn_mscale=0.7),
        **ROUTING,
    ),
    "noq-yarn-halves-tied-raw-topk": dict(
        _sizes(59, 24, 2, 30),
        **mla_sizes(None, 8, 6, 4, 7),
        rope_interleave=False,
        tie_embeddings=True,
        **deepseek_moe(0, 6, 3, 6),
        norm_topk_prob=False,
        **yarn(4.0, 4, 0.5),
        **ROUTING,
    ),
    "qlora-plain-rope-no-bias-two-dense": dict(
        _sizes(53, 24, 4, 20),
        **mla_sizes(8, 6, 2, 6, 4),
        **deepseek_moe(2, 4, 2, 6),
        router_score="sigmoid",
        aux_loss="none",
        rope_theta=5e5,
        norm_eps=1e-5,
    ),
}


def _fastpar_model(cfg: DeepSeekConfig, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*build_deepseek(cfg))
    perturb_(model, seed + 1)
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and the routers' expert_bias buffers, by global name."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bias_zeros(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradient of each expert_bias, to map beside the parameters' (a buffer: zeros)."""
    return {k: torch.zeros_like(b) for k, b in model.named_buffers() if "expert_bias" in k}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_every_gradient_equal_hf(name):
    cfg = routed(DeepSeekConfig, layers=3, seq_len=16, **VARIANTS[name])
    ours = _fastpar_model(cfg)
    hf = hf_model(hf_config(cfg))
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    hf.load_state_dict(to_hf(_state(ours), cfg), strict=True)
    map_grads = lambda g: to_hf({**g, **_bias_zeros(ours)}, cfg)  # noqa: E731
    grads, hf_params, length = against_hf(ours, hf, cfg, deepseek_loss, map_grads)
    assert set(hf_params) <= set(grads[0])
    for k in hf_params:
        if hf_params[k].numel() == 0:  # n_shared_experts = 0: zero-width projections
            continue
        agree_three(hf_params[k].grad, [g[k] for g in grads], f"HF's gradient of {k}", length)


def test_yarn_and_interleave_change_the_function():
    """The variants above would pass vacuously if YaRN or the interleaved layout did nothing:
    each changes the logits of the same weights."""
    cfg = routed(
        DeepSeekConfig, layers=2, seq_len=16, **VARIANTS["qlora-yarn-interleaved-groups-shared"]
    )
    model = _fastpar_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids)
        for change in (
            dict(
                yarn_factor=None,
                yarn_original_seq_len=None,
                yarn_mscale=1.0,
                yarn_mscale_all_dim=0.0,
            ),
            dict(rope_interleave=False),
        ):
            other = torch.nn.Sequential(*build_deepseek(dataclasses.replace(cfg, **change)))
            other.load_state_dict(model.state_dict())
            assert (other(ids) - base).abs().max() > 1e-3, change


@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_hf_loads_an_hf_model_and_maps_back_bit_for_bit(name):
    cfg = routed(DeepSeekConfig, layers=3, seq_len=16, **VARIANTS[name])
    check_from_hf(cfg, build_deepseek, from_hf, hf_config, to_hf)


def test_hf_mapping_refuses_what_hf_does_not_compute():
    base = dict(layers=3, seq_len=16, **VARIANTS["qlora-plain-rope-no-bias-two-dense"])
    refused = {
        "moe_every=2 has no HF export": dict(moe_every=2, first_k_dense=0),
        "router_score='softmax' has no HF export: DeepSeek-V3 routes by sigmoid": dict(
            router_score="softmax"
        ),
        "capacity_factor=1.25 has no HF export": dict(capacity_factor=1.25),
        "shared_expert_ffn=7 has no HF export": dict(shared_expert_ffn=7),
        "groups of at least 2 experts": dict(router_groups=4, router_group_topk=2),
    }
    for message, change in refused.items():
        cfg = routed(DeepSeekConfig, **{**base, **change})
        with pytest.raises(ValueError, match=message):
            hf_config(cfg)
        with pytest.raises(ValueError, match=message):
            to_hf({}, cfg)
    cfg = routed(DeepSeekConfig, **base)
    state = _state(_fastpar_model(cfg))
    bad = {
        "attention_bias=True is not supported": {"attention_bias": True},
        "num_key_value_heads=2 is not supported": {"num_key_value_heads": 2},
        "hidden_act='gelu' is not supported": {"hidden_act": "gelu"},
        "model_type 'llama' is not 'deepseek_v3'": {"model_type": "llama"},
    }
    hf_state, config = check_mapping_refusals(state, cfg, to_hf, hf_config, from_hf, bad)
    with pytest.raises(ValueError, match=r"1 tensors have no fastpar name"):
        from_hf({**hf_state, "model.layers.3.mlp.gate.weight": torch.zeros(1)}, config)


def _trained_and_exported(tmp_path, **layout):
    """A DeepSeek of 3 layers under DeepSeek-V3's routing trained 2 steps at ``layout``, saved at
    step 2 and exported by ``python -m fastpar.export``'s code to ``tmp_path / "hf"``: (the
    run's TrainConfig, the exported state, the HF config)."""
    from fastpar.export import export
    from fastpar.train import TrainConfig, launch

    ckpt = tmp_path / "ckpt"
    run = tiny_config(DEEPSEEK, model_type="deepseek", layers=3, **layout)
    cfg = TrainConfig.from_flags(**run, checkpoint_dir=str(ckpt), save_every=2)
    launch(cfg)
    _, state, config = export(str(ckpt / "step_000002"), str(tmp_path / "hf"))
    return cfg, state, config


@pytest.mark.slow  # (a pp 2 checkpoint with MTP is exported below in the CPU tier)
def test_a_checkpoint_trained_at_dp_tp_pp_ep_exports_to_hf(tmp_path):
    """Trained at dp 2 x tp 2 x pp 2 x ep 2 with DeepSeek-V3 routing (the expert bias moved by
    the steps), exported by ``python -m fastpar.export``'s code and loaded by transformers'
    from_pretrained (its default experts implementation): the same logits as the
    single-process fastpar model holding the checkpoint's tensors, expert biases included."""
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    from fastpar.export import fastpar_model

    cfg, state, config = _trained_and_exported(tmp_path, tp=2, pp=2, dp=2, ep=2)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert any(state[k].abs().max() > 0 for k in state if k.endswith("expert_bias"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    )
    ours = fastpar_model(cfg, state).model
    ids = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), aux_loss_scale(None):
        runs = [m(ids).view(2, 16, -1) for m in three(ours)]
        agree_three(hf(ids).logits, runs, "from_pretrained's logits", reduction_length(ours, ids))


def _hf_weights_at_tp2_ep2(config, hf_state, batch, runs, length) -> None:
    """HF's weights in a TP 2 x EP 2 (x DP 2) fastpar model, every rank on the same batch:
    logits, loss and every gradient against the single-process model holding them (an
    expert's gradient sums both EP ranks' tokens: twice the single-process one)."""
    from fastpar.checkpoint.state import localize
    from fastpar.mesh.placement import is_expert

    mesh = make_mesh(tp=2, ep=2, dp=2)
    cfg, state = from_hf(hf_state, config)
    par = torch.nn.Sequential(*build_deepseek(cfg, mesh))
    params = dict(par.named_parameters())
    import_state_dict(state, params)
    with torch.no_grad():
        for name, b in par.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(state[name])
    (ids, targets), grads = batch, runs[2]
    where = f"rank {dist.get_rank()}"
    out = without_aux_loss(par, ids)
    agree_tp_output(out, targets, cfg, mesh, deepseek_loss, runs, length, where).backward()
    for name, p in params.items():
        scale = 2 if is_expert(p) else 1
        want = [localize(scale * g[name], p) for g in grads]
        agree_three(p.grad, want, f"grad of {name} on rank {dist.get_rank()}", length)


def test_hf_weights_at_tp2_ep2_give_hf_logits_and_gradients():
    cfg = routed(
        DeepSeekConfig, layers=3, seq_len=16, **VARIANTS["qlora-yarn-interleaved-groups-shared"]
    )
    torch.manual_seed(2)
    hf = hf_model(hf_config(cfg))
    perturb_(hf, 3)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    got_cfg, state = from_hf(hf_state, hf.config.to_dict())
    single = torch.nn.Sequential(*build_deepseek(got_cfg))
    single.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    length = reduction_length(single, ids)
    loss = lambda out, t: deepseek_loss(out, t, got_cfg)  # noqa: E731
    logits, losses, grads = three_runs(single, ids, targets, loss, without_aux_loss)
    want = hf(ids).logits
    agree_three(want.detach().flatten(0, 1), logits, "HF's logits", length)
    torch.nn.functional.cross_entropy(want.flatten(0, 1), targets.flatten()).backward()
    mapped = [to_hf({**g, **_bias_zeros(single)}, got_cfg) for g in grads]
    for k, p in hf.named_parameters():
        if p.numel():
            agree_three(p.grad, [g[k] for g in mapped], f"HF's gradient of {k}", length)
    runs = (logits, losses, grads)
    run_ranks(
        _hf_weights_at_tp2_ep2, 4, hf.config.to_dict(), hf_state, (ids, targets), runs, length
    )


# -- HF names of the MTP modules ------------------------------------------------------------------
MTP_HF = {
    **_sizes(61, 32, 4, 40),
    **dict(seq_len=16, layers=2, **deepseek_moe(1, 4, 2, 8), **mla_sizes(10, 12, 4, 6, 5)),
    **{**DEEPSEEK, "aux_loss": "none"},
}


@pytest.mark.parametrize("depth, tied", [(1, False), (2, True)], ids=["d1-untied", "d2-tied"])
def test_mtp_weights_map_to_deepseek_v3_names_and_back_bit_for_bit(depth, tied):
    cfg = routed(DeepSeekConfig, **MTP_HF, mtp_depth=depth, tie_embeddings=tied)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*build_deepseek(cfg))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = to_hf(state, cfg)
    config = hf_config(cfg)
    assert config["num_nextn_predict_layers"] == depth
    assert config["first_k_dense_replace"] == 1
    for k in range(1, depth + 1):
        layer, ours = f"model.layers.{cfg.layers + k - 1}.", f"{cfg.layers + 1}.mtp.{k - 1}."
        assert torch.equal(hf[layer + "enorm.weight"], state[ours + "enorm.weight"])
        assert torch.equal(hf[layer + "hnorm.weight"], state[ours + "hnorm.weight"])
        assert torch.equal(hf[layer + "eh_proj.weight"], state[ours + "eh_proj.weight"])
        assert torch.equal(hf[layer + "shared_head.norm.weight"], state[ours + "norm.weight"])
        assert torch.equal(hf[layer + "shared_head.head.weight"], hf["lm_head.weight"])
        assert torch.equal(hf[layer + "embed_tokens.weight"], hf["model.embed_tokens.weight"])
        # DeepSeek-V3's MTP blocks are MoE blocks (every layer after first_k_dense is)
        assert layer + "mlp.gate.e_score_correction_bias" in hf
        assert layer + "self_attn.kv_a_proj_with_mqa.weight" in hf
        assert is_mtp_name(layer + "eh_proj.weight", cfg)
    assert not is_mtp_name(f"model.layers.{cfg.layers - 1}.mlp.gate.weight", cfg)
    got_cfg, back = from_hf(hf, config)
    router = dataclasses.replace(got_cfg.moe_router, aux_loss=cfg.moe_router.aux_loss)
    assert dataclasses.replace(got_cfg, moe_router=router) == cfg  # (HF has no aux loss)
    # (the MTP head's "embedding" is a second name of 0.tok.weight)
    want = {k: t for k, t in state.items() if k != f"{cfg.layers + 1}.embedding"}
    assert sorted(back) == sorted(want)
    for k, t in want.items():
        assert torch.equal(back[k], t), k


def test_from_hf_refuses_mtp_layers_it_cannot_take():
    cfg = routed(DeepSeekConfig, **MTP_HF, mtp_depth=1)
    torch.manual_seed(0)
    state = dict(torch.nn.Sequential(*build_deepseek(cfg)).state_dict())
    hf, config = to_hf(state, cfg), hf_config(cfg)
    without = {k: v for k, v in hf.items() if not is_mtp_name(k, cfg)}
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers 1 but the weights hold no"):
        from_hf(without, config)
    other = dict(hf, **{"model.layers.2.shared_head.head.weight": hf["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match=r"shared_head.head.weight differs from lm_head.weight"):
        from_hf(other, config)
    assert from_hf(without, {**config, "num_nextn_predict_layers": 0})[0].mtp_depth == 0


@pytest.mark.slow  # (the MtpLayer test below reads the exported names in the CPU tier)
def test_a_checkpoint_with_mtp_exports_for_from_pretrained(tmp_path):
    """Trained at pp 2 with one MTP module, exported by ``python -m fastpar.export``'s code:
    from_pretrained's logits equal fastpar's single-process model holding the checkpoint, the
    MTP tensors lie in the safetensors files under DeepSeek-V3's names, and from_hf of those
    files gives the checkpoint's tensors back bit for bit."""
    safetensors = pytest.importorskip("safetensors.torch")
    transformers = pytest.importorskip("transformers")
    from _parity import agree, exact_copy

    from fastpar.export import check, fastpar_model
    from fastpar.moe.layer import aux_loss_scale
    from fastpar.parity import reduction_length
    from fastpar.tolerance import nudge

    cfg, state, config = _trained_and_exported(tmp_path, mtp_depth=1, tp=1, pp=2, dp=1, ep=1)
    out = tmp_path / "hf"
    assert config["num_nextn_predict_layers"] == 1
    files = safetensors.load_file(str(out / "model.safetensors"))
    layer = f"model.layers.{cfg.model.layers}."
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "input_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.experts.gate_up_proj",
    ):
        assert layer + name in files, name
    head = f"{cfg.model.layers + 1}.mtp.0."
    assert torch.equal(files[layer + "eh_proj.weight"], state[head + "eh_proj.weight"])
    got_cfg, back = from_hf(files, config)
    assert (got_cfg.mtp_depth, got_cfg.layers, got_cfg.first_k_dense) == (1, cfg.model.layers, 1)
    assert set(back) - set(state) == {f"{cfg.model.layers + 1}.weight"}  # the tied head, named
    assert set(state) <= set(back)
    for k, t in state.items():
        assert torch.equal(back[k], t), k
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ours = fastpar_model(cfg, state).model.eval()
    ids = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    twin = exact_copy(ours).float()
    nudge(twin, seed=1)
    with torch.no_grad(), aux_loss_scale(None):
        runs = [m(ids).view(2, 16, -1) for m in (ours, twin, exact_copy(ours))]
        length = reduction_length(ours, ids)
        agree(hf(ids).logits, runs[:2], runs[2], "from_pretrained's logits", length=length)
    assert check(str(out), cfg, state, "the fox", 3, None)


def test_the_mtp_module_is_what_transformers_mtp_layer_computes_from_the_exported_weights():
    """fastpar's depth-1 logits against transformers' own ``MtpLayer`` (the MTP drafter's layer:
    [enorm(e); hnorm(h)] -> eh_proj -> a ``DeepseekV3DecoderLayer`` -> post_norm, the shared
    head) holding the exported ``model.layers.{L}.*`` tensors, on the HF model's last hidden
    state before its final norm: the names mean what DeepSeek-V3's mean."""
    transformers = pytest.importorskip("transformers")
    layers = pytest.importorskip("transformers.modeling_layers")
    from _parity import agree, exact_copy
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from fastpar.models.mtp import tokens
    from fastpar.moe.layer import aux_loss_scale
    from fastpar.parity import reduction_length
    from fastpar.tolerance import nudge

    cfg = routed(DeepSeekConfig, **MTP_HF, mtp_depth=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*build_deepseek(cfg))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms start at one: move them, so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.add_(0.1 * torch.randn(b.shape, generator=g))
    hf_state = to_hf(dict(model.state_dict()), cfg)
    config = transformers.AutoConfig.for_model(**hf_config(cfg))
    hf = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    main = {k: v for k, v in hf_state.items() if not is_mtp_name(k, cfg)}
    hf.load_state_dict(main, strict=True)
    prefix = f"model.layers.{cfg.layers}."
    norm = ds.DeepseekV3RMSNorm
    mtp = layers.MtpLayer(config, ds.DeepseekV3DecoderLayer, norm, cfg.layers)
    mtp.eval()
    rename = {
        "shared_head.norm.": "post_norm.",
        "enorm.": "enorm.",
        "hnorm.": "hnorm.",
        "eh_proj.": "eh_proj.",
    }
    theirs = {}
    for k, v in hf_state.items():
        if not k.startswith(prefix) or k.endswith(("embed_tokens.weight", "head.weight")):
            continue
        rest = k[len(prefix) :]
        head = next((a for a in rename if rest.startswith(a)), None)
        theirs[rename[head] + rest[len(head) :] if head else "mtp_block." + rest] = v
    mtp.load_state_dict(theirs, strict=True)
    t = cfg.seq_len
    ids = torch.randint(0, cfg.vocab_size, (2, t), generator=torch.Generator().manual_seed(2))
    seen = {}
    hook = hf.model.norm.register_forward_hook(lambda m, args, out: seen.update(h=args[0]))
    with torch.no_grad(), aux_loss_scale(None):
        hf(ids)
        hook.remove()
        pos = torch.arange(t - 1).expand(2, -1)
        e = hf.model.embed_tokens(ids[:, 1:])
        mask = torch.full((t - 1, t - 1), float("-inf")).triu(1)[None, None].expand(2, 1, -1, -1)
        rope = hf.model.rotary_emb(e, position_ids=pos)
        out = mtp(e, seen["h"][:, :-1], rope, mask, pos, None)
        want = hf.lm_head(out)  # [2, t - 1, vocab]
        model.train()
        twin = exact_copy(model).float()
        nudge(twin, seed=1)
        runs = []
        for m in (model, twin, exact_copy(model)):
            with tokens(ids):
                runs.append(m(ids).depths[0].view(2, t, -1)[:, : t - 1, : cfg.vocab_size])
        length = reduction_length(model, ids)
        agree(want, runs[:2], runs[2], "MtpLayer's depth-1 logits", length=length)
