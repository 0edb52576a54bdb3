"""Models built only from fastpar layers: a GPT, a Llama-class decoder (Llama, Qwen2, Qwen3
shapes) and a DeepSeek-V3-class decoder (latent attention, DeepSeekMoE), all as lists of
pipeline blocks [embedding, block x layers, head]."""

from __future__ import annotations

from fastpar.models.common import lm_loss, untie_for_pipeline
from fastpar.models.deepseek import DeepSeekConfig, build_deepseek, deepseek_loss
from fastpar.models.gpt import GPTConfig, build_gpt, gpt_loss
from fastpar.models.llama import LlamaConfig, build_llama, llama_loss
from fastpar.models.llama_hf import from_hf, hf_config, to_hf


def build_model(cfg: GPTConfig | LlamaConfig | DeepSeekConfig, mesh=None):
    """``build_gpt``, ``build_llama`` or ``build_deepseek``, whichever ``cfg`` configures."""
    if isinstance(cfg, GPTConfig):
        return build_gpt(cfg, mesh)
    if isinstance(cfg, LlamaConfig):
        return build_llama(cfg, mesh)
    if isinstance(cfg, DeepSeekConfig):
        return build_deepseek(cfg, mesh)
    raise TypeError(
        f"expected a GPTConfig, a LlamaConfig or a DeepSeekConfig, got {type(cfg).__name__}"
    )


__all__ = [
    "DeepSeekConfig",
    "GPTConfig",
    "LlamaConfig",
    "build_deepseek",
    "build_gpt",
    "build_llama",
    "build_model",
    "deepseek_loss",
    "from_hf",
    "gpt_loss",
    "hf_config",
    "llama_loss",
    "lm_loss",
    "to_hf",
    "untie_for_pipeline",
]
