"""The fastpar Llama's weights and config under Hugging Face names, both ways.

    hf_state = to_hf(state, cfg)          # fastpar names -> Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral
    config = hf_config(cfg)               # config.json content
    cfg, state = from_hf(hf_state, config)

Which family an option set maps to, and what is not mapped: docs/hf.md ("The name mappings")."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fastpar import families
from fastpar.models import llama
from fastpar.models.llama import LlamaConfig
from fastpar.moe.config import ROUTING_DEFAULTS

__all__ = ["from_hf", "hf_config", "hf_model_type", "to_hf"]


def hf_model_type(cfg: LlamaConfig) -> str:
    """The HF family of ``cfg``: "qwen3" (qk_norm), "qwen2" (attention_bias) or "llama"; with
    MoE blocks "qwen3_moe" (qk_norm) or "mixtral". ValueError for what no HF family computes."""
    if cfg.qk_norm and cfg.attention_bias:
        raise ValueError(
            "qk_norm with attention_bias has no HF family: Qwen3 (q/k norm) puts its bias on "
            "o_proj too, Qwen2 (q/k/v bias) has no q/k norm; drop one of the two"
        )
    if getattr(cfg, "mtp_depth", 0):
        raise ValueError(
            f"mtp_depth {cfg.mtp_depth}: the Llama-class HF families have no multi-token "
            "prediction modules, so their weights have no HF name; keep the fastpar checkpoint "
            "(or train without --mtp-depth)"
        )
    if not cfg.moe_every:
        return _dense_family(cfg)
    routing = ("router_score", "routed_scaling_factor", "router_groups", "expert_bias")
    routing += ("shared_expert_ffn",)
    values = llama.routing(cfg)
    changed = {k: values[k] for k in routing if values[k] != ROUTING_DEFAULTS[k]}
    if changed:
        raise ValueError(
            f"a MoE model with DeepSeek-style routing or shared experts ({changed}) has no HF "
            "export here: Qwen3-MoE and Mixtral route by a softmax top-k without a bias, groups, "
            "scaling or shared experts, so they would compute another function; keep the "
            "fastpar checkpoint (or load the blocks into HF with fastpar.moe.moe_to_hf_state_dict)"
        )
    if cfg.capacity_factor is not None:
        raise ValueError(
            f"a MoE model with capacity_factor={cfg.capacity_factor} has no HF export: HF's MoE "
            f"models (Qwen3-MoE, Mixtral) drop no tokens, so they would compute another "
            f"function; train it dropless (capacity_factor=None)"
        )
    return _moe_family(cfg)


def _attention_words(qk_norm: bool, bias: bool) -> str:
    return " and ".join(w for w, on in (("qk_norm", qk_norm), ("attention_bias", bias)) if on)


def _moe_family(cfg: LlamaConfig) -> str:
    """The family with ``llama_moe`` whose attention is ``cfg``'s and whose config.json can
    hold its MoE placement (``moe_every``) and top-k normalisation; ValueError naming why not."""
    mine = [(n, families.get(n)) for n in families.names("llama_arch")]
    mine = [(n, f) for n, f in mine if f.llama_moe is not None]
    want = (bool(cfg.qk_norm), bool(cfg.attention_bias))
    fits = [(n, f) for n, f in mine if (f.qk_norm, f.qkv_bias) == want]
    if not fits:
        have = ", ".join(
            f"{f.llama_moe.title} ({_attention_words(f.qk_norm, f.qkv_bias) or 'plain attention'})"
            for _, f in mine
        )
        raise ValueError(
            f"MoE blocks with {_attention_words(*want) or 'plain attention'} have no HF family: "
            f"the MoE families fastpar's Llama maps are {have}; change the attention to one of them"
        )
    others = [f for _, f in mine if (f.qk_norm, f.qkv_bias) != want]
    for name, family in fits:
        moe = family.llama_moe
        if moe.sparse_step is None and cfg.moe_every != 1:
            alt = "; ".join(
                f"or qk_norm={o.qk_norm} ({o.llama_moe.title}, whose {o.llama_moe.sparse_step} is moe_every)"
                for o in others
                if o.llama_moe.sparse_step
            )
            raise ValueError(
                f"moe_every={cfg.moe_every} without qk_norm has no HF family: {moe.title} has a "
                f"MoE in every block; use moe_every=1 ({moe.title}) {alt}".rstrip()
            )
        if moe.norm_topk is None and not cfg.norm_topk_prob:
            alt = "; ".join(
                f"or qk_norm={o.qk_norm} ({o.llama_moe.title})"
                for o in others
                if o.llama_moe.norm_topk
            )
            raise ValueError(
                f"norm_topk_prob=False without qk_norm has no HF family: {moe.title} always "
                f"renormalises the top-k routing weights; set norm_topk_prob=True, {alt}".rstrip(
                    ", "
                )
            )
        return name
    raise AssertionError("unreachable")


def _dense_family(cfg: LlamaConfig) -> str:
    """The first dense family fastpar's Llama converts to whose attention (``Family.qk_norm``,
    ``Family.qkv_bias``) is ``cfg``'s."""
    want = (bool(cfg.qk_norm), bool(cfg.attention_bias))
    for name in families.names("llama_arch"):
        family = families.get(name)
        if family.moe is None and (family.qk_norm, family.qkv_bias) == want:
            return name
    raise ValueError(
        f"no registered family with llama_arch has qk_norm={want[0]}, attention_bias={want[1]}"
    )


def hf_config(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    """config.json content for ``cfg`` (AutoConfig.for_model(**it) or from_dict reads it)."""
    model_type = hf_model_type(cfg)
    family = families.get(model_type)
    out = {
        "architectures": [family.llama_arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # what transformers 4 reads
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": dtype,
    }
    out.update(family.llama_fixed)
    moe = family.llama_moe
    if cfg.moe_every:
        out.update({k: v for k, (v, _) in moe.fixed.items()})
        out.update(num_experts_per_tok=cfg.top_k, output_router_logits=False)
        out.update({moe.experts[0]: cfg.num_experts, moe.ffn: cfg.moe_ffn_size})
        if moe.sparse_step:
            out[moe.sparse_step] = cfg.moe_every
        if moe.norm_topk:
            out[moe.norm_topk] = cfg.norm_topk_prob
    return out


def _take(state: Mapping[str, torch.Tensor], name: str, used: set) -> torch.Tensor:
    if name not in state:
        raise KeyError(f"{name!r} is absent from the state dict")
    used.add(name)
    return state[name]


def _shaped_take(state: Mapping[str, torch.Tensor], used: set) -> Callable:
    """``take(name, shape)``: ``state[name]`` (marked used), refused unless of ``shape``."""

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = _take(state, name, used)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape} for this config")
        return t

    return take


def _head_to_hf(take: Callable, out: dict, used: set, cfg) -> None:
    """The final norm and the head under HF names (the embedding itself when tied)."""
    head = f"{cfg.layers + 1}."
    out["model.norm.weight"] = take(head + "norm.weight", (cfg.hidden,))
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
        used.add(head + "weight")  # a pipeline's untied copy of the tied weight, if exported
    else:
        out["lm_head.weight"] = take(head + "weight", (cfg.vocab_size, cfg.hidden))


def _head_from_hf(hf_state: Mapping[str, torch.Tensor], used: set, state: dict, cfg) -> None:
    """The final norm and the head under fastpar's names (the embedding when tied)."""
    head = f"{cfg.layers + 1}."
    state[head + "norm.weight"] = _take(hf_state, "model.norm.weight", used)
    if cfg.tie_embeddings:  # the head's alias of the embedding, as in the model's state_dict()
        used.add("lm_head.weight")
        state[head + "weight"] = state["0.tok.weight"]
    else:
        state[head + "weight"] = _take(hf_state, "lm_head.weight", used)


def _check_all_used(state: Mapping[str, torch.Tensor], used: set) -> None:
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(
            f"to_hf: {len(unused)} tensors of the state dict have no HF name under this config "
            f"(first: {unused[:3]}); is the config the one the model was built with?"
        )


def to_hf(state: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """fastpar global names -> HF names (``lm_head.weight`` is the embedding itself when tied).
    Raises for a missing tensor, a tensor of the wrong shape or one the mapping does not use."""
    hf_model_type(cfg)
    d, kv, rep = cfg.head_size, cfg.num_kv_heads, cfg.heads // cfg.num_kv_heads
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    take = _shaped_take(state, used)
    out["model.embed_tokens.weight"] = take("0.tok.weight", (cfg.vocab_size, cfg.hidden))
    for i in range(cfg.layers):
        src, dst = f"{i + 1}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "norm1.weight", (cfg.hidden,))
        out[dst + "post_attention_layernorm.weight"] = take(src + "norm2.weight", (cfg.hidden,))
        names = ["weight", "bias"] if cfg.attention_bias else ["weight"]
        for kind in names:
            shape = ((cfg.heads + 2 * kv) * d, cfg.hidden)[: 2 if kind == "weight" else 1]
            grouped = take(src + f"attn.qkv.{kind}", shape).reshape(kv, rep + 2, d, -1)
            rest = () if kind == "bias" else (cfg.hidden,)
            attn = dst + "self_attn."
            out[attn + f"q_proj.{kind}"] = grouped[:, :rep].reshape(cfg.heads * d, *rest)
            out[attn + f"k_proj.{kind}"] = grouped[:, rep].reshape(kv * d, *rest)
            out[attn + f"v_proj.{kind}"] = grouped[:, rep + 1].reshape(kv * d, *rest)
        if cfg.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = take(src + "attn.q_norm.weight", (d,))
            out[dst + "self_attn.k_norm.weight"] = take(src + "attn.k_norm.weight", (d,))
        out[dst + "self_attn.o_proj.weight"] = take(
            src + "attn.o.weight", (cfg.hidden, cfg.heads * d)
        )
        if cfg.is_moe(i):
            e, f = cfg.num_experts, cfg.moe_ffn_size
            out[dst + "mlp.gate.weight"] = take(src + "mlp.router.weight", (e, cfg.hidden))
            w1 = take(src + "mlp.w1", (e, cfg.hidden, 2 * f))
            out[dst + "mlp.experts.gate_up_proj"] = w1.transpose(1, 2).contiguous()
            w2 = take(src + "mlp.w2", (e, f, cfg.hidden))
            out[dst + "mlp.experts.down_proj"] = w2.transpose(1, 2).contiguous()
            continue
        gate, up = take(src + "mlp.gate_up.weight", (2 * cfg.ffn_size, cfg.hidden)).chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = take(
            src + "mlp.down.weight", (cfg.hidden, cfg.ffn_size)
        )
    _head_to_hf(take, out, used, cfg)
    _check_all_used(state, used)
    return out


def _refuse(config: Mapping, key: str, ok, why: str) -> None:
    value = config.get(key)
    if not ok(value):
        raise ValueError(f"from_hf: {key}={value!r} is not supported: {why}")


def _moe_options(c: Mapping, family: families.Family) -> dict:
    """LlamaConfig's MoE fields from a config.json of a family with ``llama_moe`` (none for
    the others, or when it names no experts)."""
    moe = family.llama_moe
    experts = next((c[k] for k in moe.experts if c.get(k)), None) if moe else None
    if not experts:
        return {}
    for key, (_, why) in moe.fixed.items():
        _refuse(c, key, lambda v: not v, why)
    return dict(
        moe_every=c.get(moe.sparse_step, 1) if moe.sparse_step else 1,
        num_experts=experts,
        top_k=c["num_experts_per_tok"],
        moe_ffn=c[moe.ffn],
        norm_topk_prob=bool(c.get(moe.norm_topk, False)) if moe.norm_topk else True,
    )


def from_hf(
    hf_state: Mapping[str, torch.Tensor], hf_config_dict: Mapping
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The weights and config.json content of a family with ``llama_arch`` (LlamaForCausalLM,
    Qwen2ForCausalLM, ...) -> (LlamaConfig, state under fastpar global names; the head's
    ``{L+1}.weight`` is the embedding itself when tied, as in ``state_dict()``). Its record's
    ``qk_norm`` / ``qkv_bias`` say the attention. Raises for what fastpar's Llama does not
    compute (see docs/hf.md) and for missing or unused tensors."""
    c = dict(hf_config_dict)
    model_type = c.get("model_type")
    family = families.find(model_type)
    if family is None or family.llama_arch is None:
        raise ValueError(
            f"from_hf: model_type {model_type!r} is not one of "
            f"{list(families.names('llama_arch'))} (the families "
            f"fastpar's Llama maps)"
        )
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"from_hf: rope_type {rope_type!r} is not supported: fastpar's Llama computes "
            f"default (unscaled) RoPE only"
        )
    _refuse(c, "hidden_act", lambda v: v in (None, "silu"), "the MLP is SwiGLU with SiLU")
    _refuse(c, "mlp_bias", lambda v: not v, "fastpar's Llama MLP has no bias")
    _refuse(c, "use_sliding_window", lambda v: not v, "attention is full (causal) only")
    if not family.qkv_bias:
        _refuse(c, "attention_bias", lambda v: not v, "fastpar has no o_proj bias")
    heads = c["num_attention_heads"]
    moe = _moe_options(c, family)
    cfg = LlamaConfig(
        vocab_size=c["vocab_size"],
        seq_len=c.get("max_position_embeddings", 2048),
        hidden=c["hidden_size"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        layers=c["num_hidden_layers"],
        ffn=c["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        qk_norm=family.qk_norm,
        attention_bias=family.qkv_bias,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        **moe,
    )
    cfg.check()
    d, kv, rep = cfg.head_size, cfg.num_kv_heads, cfg.heads // cfg.num_kv_heads
    used: set[str] = set()
    state: dict[str, torch.Tensor] = {
        "0.tok.weight": _take(hf_state, "model.embed_tokens.weight", used)
    }
    for i in range(cfg.layers):
        src, dst = f"model.layers.{i}.", f"{i + 1}."
        attn = src + "self_attn."
        state[dst + "norm1.weight"] = _take(hf_state, src + "input_layernorm.weight", used)
        state[dst + "norm2.weight"] = _take(hf_state, src + "post_attention_layernorm.weight", used)
        for kind in ["weight", "bias"] if cfg.attention_bias else ["weight"]:
            q = _take(hf_state, attn + f"q_proj.{kind}", used).reshape(kv, rep, d, -1)
            k = _take(hf_state, attn + f"k_proj.{kind}", used).reshape(kv, 1, d, -1)
            v = _take(hf_state, attn + f"v_proj.{kind}", used).reshape(kv, 1, d, -1)
            grouped = torch.cat([q, k, v], dim=1)
            shape = (-1, cfg.hidden) if kind == "weight" else (-1,)
            state[dst + f"attn.qkv.{kind}"] = grouped.reshape(shape)
        if cfg.qk_norm:
            state[dst + "attn.q_norm.weight"] = _take(hf_state, attn + "q_norm.weight", used)
            state[dst + "attn.k_norm.weight"] = _take(hf_state, attn + "k_norm.weight", used)
        state[dst + "attn.o.weight"] = _take(hf_state, attn + "o_proj.weight", used)
        if cfg.is_moe(i):
            mlp = src + "mlp."
            state[dst + "mlp.router.weight"] = _take(hf_state, mlp + "gate.weight", used)
            gate_up = _take(hf_state, mlp + "experts.gate_up_proj", used)
            state[dst + "mlp.w1"] = gate_up.transpose(1, 2).contiguous()
            down = _take(hf_state, mlp + "experts.down_proj", used)
            state[dst + "mlp.w2"] = down.transpose(1, 2).contiguous()
            continue
        gate = _take(hf_state, src + "mlp.gate_proj.weight", used)
        up = _take(hf_state, src + "mlp.up_proj.weight", used)
        state[dst + "mlp.gate_up.weight"] = torch.cat([gate, up])
        state[dst + "mlp.down.weight"] = _take(hf_state, src + "mlp.down_proj.weight", used)
    _head_from_hf(hf_state, used, state, cfg)
    unused = sorted(k for k in set(hf_state) - used if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(
            f"from_hf: {len(unused)} tensors have no fastpar name (first: {unused[:3]}); the "
            f"checkpoint holds weights fastpar's Llama does not compute"
        )
    return cfg, state
