"""Models built only from fastpar layers: a GPT and a Llama-class decoder (Llama, Qwen2, Qwen3
shapes), both as lists of pipeline blocks [embedding, block x layers, head]."""

from __future__ import annotations

from fastpar.models.common import lm_loss, untie_for_pipeline
from fastpar.models.gpt import GPTConfig, build_gpt, gpt_loss
from fastpar.models.llama import LlamaConfig, build_llama, llama_loss
from fastpar.models.llama_hf import from_hf, hf_config, to_hf


def build_model(cfg: GPTConfig | LlamaConfig, mesh=None):
    """``build_gpt`` or ``build_llama``, whichever ``cfg`` configures."""
    if isinstance(cfg, GPTConfig):
        return build_gpt(cfg, mesh)
    if isinstance(cfg, LlamaConfig):
        return build_llama(cfg, mesh)
    raise TypeError(f"expected a GPTConfig or a LlamaConfig, got {type(cfg).__name__}")


__all__ = [
    "GPTConfig",
    "LlamaConfig",
    "build_gpt",
    "build_llama",
    "build_model",
    "from_hf",
    "gpt_loss",
    "hf_config",
    "llama_loss",
    "lm_loss",
    "to_hf",
    "untie_for_pipeline",
]
