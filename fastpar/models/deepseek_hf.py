"""The fastpar DeepSeek's weights and config under Hugging Face's ``deepseek_v3`` names
(``DeepseekV3ForCausalLM``), both ways.

    hf_state = to_hf(state, cfg)          # fastpar names -> HF names
    config = hf_config(cfg)               # config.json content (AutoConfig.for_model(**config))
    cfg, state = from_hf(hf_state, config)

Where the MTP modules live and what is refused either way: docs/hf.md ("fastpar's DeepSeek")."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fastpar.models.deepseek import DeepSeekConfig
from fastpar.models.llama_hf import (
    _check_all_used,
    _head_from_hf,
    _head_to_hf,
    _refuse,
    _shaped_take,
    _take,
)
from fastpar.moe.config import ExpertConfig, RouterConfig

__all__ = ["check_hf", "from_hf", "hf_config", "is_mtp_name", "to_hf"]

ARCH, MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"


def _moe_layers(cfg: DeepSeekConfig) -> list[int]:
    """The MoE layers, the MTP modules' blocks (layers ``layers ..``) counted."""
    return [i for i in range(cfg.layers + cfg.mtp_depth) if cfg.is_moe(i)]


def _mtp_prefixes(cfg: DeepSeekConfig, k: int) -> tuple[str, str]:
    """(fastpar, HF) name prefixes of MTP module ``k`` (1..D): the head's ``mtp.{k-1}.`` and
    decoder layer ``layers + k - 1``, where DeepSeek-V3's checkpoints keep it."""
    return f"{cfg.layers + 1}.mtp.{k - 1}.", f"model.layers.{cfg.layers + k - 1}."


def is_mtp_name(name: str, cfg: DeepSeekConfig) -> bool:
    """Whether the HF tensor ``name`` is one of the MTP layers' (transformers'
    ``DeepseekV3ForCausalLM`` does not hold them: the export writes them beside its weights)."""
    prefixes = tuple(_mtp_prefixes(cfg, k)[1] for k in range(1, cfg.mtp_depth + 1))
    return bool(prefixes) and name.startswith(prefixes)


def check_hf(cfg: DeepSeekConfig) -> None:
    """ValueError naming the option and the fix when HF's DeepSeek-V3 would compute another
    function than ``cfg``'s model."""
    moe = _moe_layers(cfg)
    if not moe:
        return
    if moe != list(range(cfg.first_k_dense, cfg.layers + cfg.mtp_depth)):
        raise ValueError(
            f"moe_every={cfg.moe_every} has no HF export: DeepSeek-V3 has a MoE in every block "
            f"after the first first_k_dense={cfg.first_k_dense}; use moe_every=1"
        )
    if cfg.moe_router.score != "sigmoid":
        raise ValueError(
            f"router_score={cfg.moe_router.score!r} has no HF export: DeepSeek-V3 routes by sigmoid "
            "scores; set router_score='sigmoid' (--router-score sigmoid)"
        )
    if cfg.capacity_factor is not None:
        raise ValueError(
            f"capacity_factor={cfg.capacity_factor} has no HF export: DeepSeek-V3 drops no "
            "tokens; train it dropless (capacity_factor=None)"
        )
    if cfg.moe_experts.shared_gate:
        raise ValueError(
            "shared_expert_gate has no HF export: DeepSeek-V3's shared experts are ungated; "
            "drop --shared-expert-gate"
        )
    fs, f = cfg.moe_experts.shared_ffn_hidden_size, cfg.moe_ffn_size
    if fs is not None and fs % f:
        raise ValueError(
            f"shared_expert_ffn={fs} has no HF export: DeepSeek-V3's shared experts are "
            f"n_shared_experts x moe_ffn ({f}) wide; use a multiple of {f}"
        )
    groups = cfg.moe_router.num_groups or 1
    if cfg.num_experts // groups < 2:
        raise ValueError(
            f"{cfg.num_experts} experts in {groups} groups have no HF export: HF scores each "
            "group by its best two experts; use groups of at least 2 experts"
        )


def _rope_parameters(cfg: DeepSeekConfig) -> dict:
    if cfg.yarn_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": cfg.yarn_factor,
        "original_max_position_embeddings": cfg.yarn_original_len,
        "beta_fast": cfg.yarn_beta_fast,
        "beta_slow": cfg.yarn_beta_slow,
        "mscale": cfg.yarn_mscale,
        "mscale_all_dim": cfg.yarn_mscale_all_dim,
    }


def hf_config(cfg: DeepSeekConfig, dtype: str = "float32") -> dict:
    """config.json content for ``cfg`` (``check_hf`` first)."""
    check_hf(cfg)
    moe = _moe_layers(cfg)
    shared = cfg.moe_experts.shared_ffn_hidden_size
    return {
        "architectures": [ARCH],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn_size,
        "moe_intermediate_size": cfg.moe_ffn_size,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.heads,
        "n_shared_experts": 0 if shared is None else shared // cfg.moe_ffn_size,
        "n_routed_experts": cfg.num_experts,
        "routed_scaling_factor": cfg.moe_router.scaling_factor or 1.0,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_group": cfg.moe_router.num_groups or 1,
        "topk_group": cfg.moe_router.group_topk or 1,
        "num_experts_per_tok": cfg.top_k,
        "first_k_dense_replace": moe[0] if moe else cfg.layers + cfg.mtp_depth,
        "norm_topk_prob": cfg.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": _rope_parameters(cfg),
        "rope_theta": cfg.rope_theta,  # what transformers 4 reads
        "rope_interleave": cfg.rope_interleave,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": cfg.mtp_depth,
        "dtype": dtype,
    }


def _layer_names(
    cfg: DeepSeekConfig, i: int, src: str, dst: str
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(fastpar name, HF name, shape) of layer ``i``'s tensors that map one to one; the block's
    names start with ``src`` (fastpar) and ``dst`` (HF)."""
    a, b = src + "attn.", dst + "self_attn."
    h, qk, kv = cfg.hidden, cfg.heads * cfg.qk_head_dim, cfg.kv_lora_rank
    names = [
        (src + "norm1.weight", dst + "input_layernorm.weight", (h,)),
        (src + "norm2.weight", dst + "post_attention_layernorm.weight", (h,)),
        (a + "kv_a.weight", b + "kv_a_proj_with_mqa.weight", (kv + cfg.qk_rope_head_dim, h)),
        (a + "kv_norm.weight", b + "kv_a_layernorm.weight", (kv,)),
        (
            a + "kv_b.weight",
            b + "kv_b_proj.weight",
            (cfg.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv),
        ),
        (a + "o.weight", b + "o_proj.weight", (h, cfg.heads * cfg.v_head_dim)),
    ]
    r = cfg.q_lora_rank
    if r is None:
        names.append((a + "q.weight", b + "q_proj.weight", (qk, h)))
    else:
        names += [
            (a + "q_a.weight", b + "q_a_proj.weight", (r, h)),
            (a + "q_norm.weight", b + "q_a_layernorm.weight", (r,)),
            (a + "q_b.weight", b + "q_b_proj.weight", (qk, r)),
        ]
    if cfg.is_moe(i):
        names.append((src + "mlp.router.weight", dst + "mlp.gate.weight", (cfg.num_experts, h)))
    else:
        names.append((src + "mlp.down.weight", dst + "mlp.down_proj.weight", (h, cfg.ffn_size)))
    return names


def _block_to_hf(take, out: dict, cfg: DeepSeekConfig, i: int, src: str, dst: str) -> None:
    """Layer ``i``'s block (fastpar names under ``src``) into ``out`` under HF's (``dst``)."""
    for ours, theirs, shape in _layer_names(cfg, i, src, dst):
        out[theirs] = take(ours, shape)
    src, dst = src + "mlp.", dst + "mlp."
    if not cfg.is_moe(i):
        gate, up = take(src + "gate_up.weight", (2 * cfg.ffn_size, cfg.hidden)).chunk(2)
        out[dst + "gate_proj.weight"], out[dst + "up_proj.weight"] = gate, up
        return
    e, f, h = cfg.num_experts, cfg.moe_ffn_size, cfg.hidden
    if cfg.moe_router.expert_bias:
        bias = take(src + "router.expert_bias", (e,))
    else:
        bias = torch.zeros(e, dtype=torch.float32, device=out[dst + "gate.weight"].device)
    out[dst + "gate.e_score_correction_bias"] = bias
    w1 = take(src + "w1", (e, h, 2 * f))
    out[dst + "experts.gate_up_proj"] = w1.transpose(1, 2).contiguous()
    out[dst + "experts.down_proj"] = take(src + "w2", (e, f, h)).transpose(1, 2).contiguous()
    fs = cfg.moe_experts.shared_ffn_hidden_size or 0
    if fs:
        w1, w2 = take(src + "shared.w1", (h, 2 * fs)), take(src + "shared.w2", (fs, h))
    else:  # n_shared_experts = 0: HF holds zero-width projections
        w1, w2 = w1.new_empty(h, 0), w1.new_empty(0, h)
    out[dst + "shared_experts.gate_proj.weight"] = w1[:, :fs].t()
    out[dst + "shared_experts.up_proj.weight"] = w1[:, fs:].t()
    out[dst + "shared_experts.down_proj.weight"] = w2.t()


def to_hf(state: Mapping[str, torch.Tensor], cfg: DeepSeekConfig) -> dict[str, torch.Tensor]:
    """fastpar global names -> HF names (``lm_head.weight`` is the embedding itself when tied;
    ``e_score_correction_bias`` the router's ``expert_bias`` buffer, zeros without one).
    Raises for a missing tensor, a tensor of the wrong shape or one the mapping does not use."""
    check_hf(cfg)
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    take = _shaped_take(state, used)
    out["model.embed_tokens.weight"] = take("0.tok.weight", (cfg.vocab_size, cfg.hidden))
    for i in range(cfg.layers):
        _block_to_hf(take, out, cfg, i, f"{i + 1}.", f"model.layers.{i}.")
    _head_to_hf(take, out, used, cfg)
    head = f"{cfg.layers + 1}."
    h = cfg.hidden
    if cfg.mtp_depth:  # the MTP head's embedding (a state_dict's second name of it)
        used.add(head + "embedding")
    for k in range(1, cfg.mtp_depth + 1):  # where DeepSeek-V3's checkpoints keep module k
        src, dst = _mtp_prefixes(cfg, k)
        out[dst + "embed_tokens.weight"] = out["model.embed_tokens.weight"]  # shared, as
        out[dst + "shared_head.head.weight"] = out["lm_head.weight"]  # released
        out[dst + "enorm.weight"] = take(src + "enorm.weight", (h,))
        out[dst + "hnorm.weight"] = take(src + "hnorm.weight", (h,))
        out[dst + "eh_proj.weight"] = take(src + "eh_proj.weight", (h, 2 * h))  # [e | h]
        out[dst + "shared_head.norm.weight"] = take(src + "norm.weight", (h,))
        _block_to_hf(take, out, cfg, cfg.layers + k - 1, src + "block.", dst)
    _check_all_used(state, used)
    return out


def _rope_options(c: Mapping) -> dict:
    """DeepSeekConfig's rotary fields from a config.json (default or YaRN rope)."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise ValueError(
            f"from_hf: rope_type {kind!r} is not supported: fastpar's DeepSeek computes default "
            "RoPE and YaRN"
        )
    _refuse(rope, "attention_factor", lambda v: v is None, "the factor follows from mscale")
    _refuse(rope, "truncate", lambda v: v in (None, True), "HF's default (truncated) ramp only")
    seq_len = c.get("max_position_embeddings", 2048)
    original = rope.get("original_max_position_embeddings", seq_len)
    factor = rope.get("factor")
    return dict(
        rope_theta=theta,
        yarn_factor=float(factor if factor is not None else seq_len / original),
        yarn_original_seq_len=None if original == seq_len else int(original),
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        yarn_mscale=float(rope.get("mscale") or 0.0),  # unset: HF ignores mscale_all_dim there
        yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


def _block_from_hf(
    hf_state: Mapping[str, torch.Tensor], used: set, cfg: DeepSeekConfig, i: int, src: str, dst: str
) -> dict[str, torch.Tensor]:
    """Layer ``i``'s block from HF's names under ``src`` -> fastpar's under ``dst``."""
    state = {
        ours: _take(hf_state, theirs, used) for ours, theirs, _ in _layer_names(cfg, i, dst, src)
    }
    src, dst = src + "mlp.", dst + "mlp."
    if not cfg.is_moe(i):
        gate = _take(hf_state, src + "gate_proj.weight", used)
        up = _take(hf_state, src + "up_proj.weight", used)
        state[dst + "gate_up.weight"] = torch.cat([gate, up])
        return state
    state[dst + "router.expert_bias"] = _take(
        hf_state, src + "gate.e_score_correction_bias", used
    ).float()
    state[dst + "w1"] = _take(hf_state, src + "experts.gate_up_proj", used).transpose(1, 2)
    state[dst + "w2"] = _take(hf_state, src + "experts.down_proj", used).transpose(1, 2)
    gate = _take(hf_state, src + "shared_experts.gate_proj.weight", used)
    up = _take(hf_state, src + "shared_experts.up_proj.weight", used)
    down = _take(hf_state, src + "shared_experts.down_proj.weight", used)
    if cfg.moe_experts.shared_ffn_hidden_size:
        state[dst + "shared.w1"] = torch.cat([gate, up]).t().contiguous()
        state[dst + "shared.w2"] = down.t().contiguous()
    return state


def _mtp_from_hf(
    hf_state: Mapping[str, torch.Tensor], used: set, cfg: DeepSeekConfig, k: int
) -> dict[str, torch.Tensor]:
    """MTP module ``k`` from decoder layer ``layers + k - 1``; its ``embed_tokens`` and
    ``shared_head.head`` (DeepSeek-V3's checkpoints repeat them there) must be the model's."""
    ours, theirs = _mtp_prefixes(cfg, k)
    if not any(name.startswith(theirs) for name in hf_state):
        raise ValueError(
            f"from_hf: the config has num_nextn_predict_layers {cfg.mtp_depth} but the weights "
            f"hold no {theirs}* (MTP module {k}): load the checkpoint's own safetensors files "
            "(transformers' model does not keep its MTP layers), or set "
            "num_nextn_predict_layers 0 to load the model without them"
        )
    shared = (("embed_tokens.weight", "model.embed_tokens.weight"),)
    for name, same in (*shared, ("shared_head.head.weight", "lm_head.weight")):
        if theirs + name not in hf_state:
            continue
        want = hf_state[same] if same in hf_state else hf_state["model.embed_tokens.weight"]
        if not torch.equal(_take(hf_state, theirs + name, used), want):
            raise ValueError(
                f"from_hf: {theirs + name} differs from {same}: fastpar's MTP shares the "
                "model's embedding and output head"
            )
    state = {
        ours + n: _take(hf_state, theirs + hf, used)
        for n, hf in (
            ("enorm.weight", "enorm.weight"),
            ("hnorm.weight", "hnorm.weight"),
            ("eh_proj.weight", "eh_proj.weight"),
            ("norm.weight", "shared_head.norm.weight"),
        )
    }
    block = _block_from_hf(hf_state, used, cfg, cfg.layers + k - 1, theirs, ours + "block.")
    return {**state, **block}


def from_hf(
    hf_state: Mapping[str, torch.Tensor], hf_config_dict: Mapping
) -> tuple[DeepSeekConfig, dict[str, torch.Tensor]]:
    """The weights and config.json content of an HF ``deepseek_v3`` model -> (DeepSeekConfig,
    state under fastpar global names, the router's ``expert_bias`` buffers included). Raises for
    what fastpar's DeepSeek does not compute and for missing or unused tensors."""
    c = dict(hf_config_dict)
    if c.get("model_type") != MODEL_TYPE:
        raise ValueError(f"from_hf: model_type {c.get('model_type')!r} is not {MODEL_TYPE!r}")
    _refuse(c, "hidden_act", lambda v: v in (None, "silu"), "the MLPs are SwiGLU with SiLU")
    _refuse(c, "attention_bias", lambda v: not v, "fastpar's MLA has no projection biases")
    heads = c["num_attention_heads"]
    _refuse(
        c,
        "num_key_value_heads",
        lambda v: v in (None, heads),
        "MLA expands a key and value per query head (num_key_value_heads = num_attention_heads)",
    )
    groups, topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
    shared, moe_ffn = c.get("n_shared_experts") or 0, c["moe_intermediate_size"]
    scaling = float(c.get("routed_scaling_factor", 1.0))
    depth = int(c.get("num_nextn_predict_layers") or 0)  # DeepSeek-V3's MTP modules
    cfg = DeepSeekConfig(
        vocab_size=c["vocab_size"],
        seq_len=c.get("max_position_embeddings", 2048),
        hidden=c["hidden_size"],
        heads=heads,
        layers=c["num_hidden_layers"],
        ffn=c["intermediate_size"],
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        v_head_dim=c["v_head_dim"],
        rope_interleave=bool(c.get("rope_interleave", True)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        first_k_dense=min(c.get("first_k_dense_replace") or 0, c["num_hidden_layers"] + depth),
        moe_every=1,
        num_experts=c.get("n_routed_experts") or c.get("num_local_experts"),
        top_k=c["num_experts_per_tok"],
        moe_ffn=moe_ffn,
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        moe_router=RouterConfig(
            score="sigmoid",
            expert_bias=True,
            scaling_factor=None if scaling == 1.0 else scaling,
            num_groups=groups if groups > 1 else None,
            group_topk=topk_group if groups > 1 else None,
        ),
        moe_experts=ExpertConfig(
            expert="swiglu", shared_ffn_hidden_size=shared * moe_ffn if shared else None
        ),
        mtp_depth=depth,
        **_rope_options(c),
    )
    cfg.check()
    check_hf(cfg)
    used: set[str] = set()
    state = {"0.tok.weight": _take(hf_state, "model.embed_tokens.weight", used)}
    for i in range(cfg.layers):
        state.update(_block_from_hf(hf_state, used, cfg, i, f"model.layers.{i}.", f"{i + 1}."))
    _head_from_hf(hf_state, used, state, cfg)
    for k in range(1, depth + 1):
        state.update(_mtp_from_hf(hf_state, used, cfg, k))
    unused = sorted(k for k in set(hf_state) - used if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(
            f"from_hf: {len(unused)} tensors have no fastpar name (first: {unused[:3]}); the "
            f"checkpoint holds weights fastpar's DeepSeek does not compute (MTP layers?)"
        )
    return cfg, {k: v.contiguous() for k, v in state.items()}
