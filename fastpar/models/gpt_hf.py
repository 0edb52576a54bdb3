"""The fastpar GPT's weights and config under Hugging Face GPT-2's names (``GPT2LMHeadModel``),
for a GPT with LayerNorm and no MoE blocks (``check`` refuses the rest).

    hf_state = to_hf(state, cfg)          # fastpar names -> transformer.h.N.attn.c_attn.weight ...
    config = hf_config(cfg)               # config.json content (model_type "gpt2")

The mapping: docs/hf.md ("The name mappings")."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fastpar.models.gpt import GPTConfig

__all__ = ["check", "hf_config", "to_hf"]

LAYER_NORM_EPS = 1e-5
"""The GPT's LayerNorm eps (``fastpar.models.common.Norm``'s default: torch's)."""


def check(cfg: GPTConfig) -> None:
    """Raise ValueError naming the training option GPT-2 cannot express, and the fix."""
    if cfg.norm != "layernorm":
        raise ValueError(
            f"--norm {cfg.norm}: GPT-2 normalises with LayerNorm (weight and bias), so a "
            f"--model gpt run exports as GPT-2 only when trained with --norm layernorm"
        )
    if cfg.moe_every:
        raise ValueError(
            f"--moe-every {cfg.moe_every}: GPT-2 has no MoE blocks, so a --model gpt run exports "
            f"as GPT-2 only when trained with --moe-every 0 (or train --model llama, whose MoE "
            f"exports as Qwen3-MoE / Mixtral)"
        )


def _gpt2_sizes(cfg: GPTConfig) -> dict:
    """The model's sizes under GPT-2's config.json names (also the exported code's)."""
    return {
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.hidden,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": cfg.ffn_size,
    }


def hf_config(cfg: GPTConfig, dtype: str = "float32") -> dict:
    """config.json content for ``cfg`` (``transformers.GPT2Config``); no special tokens (the
    exporter sets the run's)."""
    check(cfg)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **_gpt2_sizes(cfg),
        "activation_function": "gelu",  # F.gelu: exact erf GELU
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": dtype,
    }


def to_hf(state: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """fastpar global names -> GPT-2's (``lm_head.weight`` is ``wte`` itself when tied). Raises
    for a missing tensor, one of the wrong shape or one the mapping does not use."""
    check(cfg)
    h, f, used = cfg.hidden, cfg.ffn_size, set()

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"{name!r} is absent from the state dict")
        used.add(name)
        t = state[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape} for this config")
        return t

    out = {
        "transformer.wte.weight": take("0.tok.weight", (cfg.vocab_size, h)),
        "transformer.wpe.weight": take("0.pos.weight", (cfg.seq_len, h)),
    }
    for i in range(cfg.layers):
        src, dst = f"{i + 1}.", f"transformer.h.{i}."
        qkv = take(src + "attn.qkv.weight", (3 * h, h))
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[dst + f"{theirs}.weight"] = take(src + f"{ours}.weight", (h,))
            out[dst + f"{theirs}.bias"] = take(src + f"{ours}.bias", (h,))
        # Conv1D: weight [in, out] (x @ W + b), the transpose of nn.Linear's [out, in]
        out[dst + "attn.c_attn.weight"] = qkv.t().contiguous()
        out[dst + "attn.c_attn.bias"] = qkv.new_zeros(3 * h)
        proj = take(src + "attn.proj.weight", (h, h))
        out[dst + "attn.c_proj.weight"] = proj.t().contiguous()
        out[dst + "attn.c_proj.bias"] = proj.new_zeros(h)
        out[dst + "mlp.c_fc.weight"] = take(src + "mlp.fc.weight", (f, h)).t().contiguous()
        out[dst + "mlp.c_fc.bias"] = take(src + "mlp.fc.bias", (f,))
        out[dst + "mlp.c_proj.weight"] = take(src + "mlp.proj.weight", (h, f)).t().contiguous()
        out[dst + "mlp.c_proj.bias"] = take(src + "mlp.proj.bias", (h,))
    head = f"{cfg.layers + 1}."
    out["transformer.ln_f.weight"] = take(head + "norm.weight", (h,))
    out["transformer.ln_f.bias"] = take(head + "norm.bias", (h,))
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
        used.add(head + "weight")  # a pipeline's copy of the tied weight, if exported
    else:
        out["lm_head.weight"] = take(head + "weight", (cfg.vocab_size, h))
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(
            f"to_hf: {len(unused)} tensors of the state dict have no GPT-2 name under this "
            f"config (first: {unused[:3]}); is the config the one the model was built with?"
        )
    return out
