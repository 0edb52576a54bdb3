"""Models built only from fastpar layers: a GPT, a Llama-class decoder (Llama, Qwen2, Qwen3
shapes) and a DeepSeek-V3-class decoder (latent attention, DeepSeekMoE), all as lists of
pipeline blocks [embedding, block x layers, head]."""

from __future__ import annotations

from fastpar.mesh.groups import ParallelMesh
from fastpar.models import native
from fastpar.models.common import lm_loss, untie_for_pipeline
from fastpar.models.deepseek import DeepSeekConfig, build_deepseek, deepseek_loss
from fastpar.models.gpt import GPTConfig, build_gpt, gpt_loss
from fastpar.models.llama import LlamaConfig, build_llama, llama_loss
from fastpar.models.llama_hf import from_hf, hf_config, to_hf


def build_model(cfg, mesh: ParallelMesh | None = None):
    """The native model ``cfg`` configures (``fastpar.models.native``: ``build_gpt``,
    ``build_llama``, ``build_deepseek``, or a registered one's)."""
    return native.of_config(cfg).build(cfg, mesh)


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
    "native",
    "to_hf",
    "untie_for_pipeline",
]
