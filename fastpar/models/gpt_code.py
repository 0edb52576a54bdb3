"""A ``--model gpt`` that GPT-2 cannot express (RMSNorm, MoE blocks), as a Hugging Face model with
its own code: ``hf_config``, ``to_hf`` and ``write_code`` (the ``fastpar/models/hf_code`` files,
loaded with ``trust_remote_code=True``). A capacity factor is refused (docs/hf.md)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping

import torch

from fastpar.models.gpt import GPTConfig
from fastpar.models.gpt_hf import _gpt2_sizes

__all__ = ["CODE_FILES", "check", "hf_config", "to_hf", "write_code"]

CODE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_code")
CODE_FILES = ("configuration_fastpar_gpt.py", "modeling_fastpar_gpt.py")
"""What ``write_code`` copies into an exported directory (``auto_map`` names them)."""

MODEL_TYPE = "fastpar_gpt"


#: the router scores the exported code (fastpar/models/hf_code/) computes
EXPORTED_SCORES = ("softmax", "sigmoid")


def check(cfg: GPTConfig) -> None:
    """Raise ValueError naming what the exported model cannot compute exactly, and the fix."""
    if cfg.moe_every and cfg.capacity_factor is not None:
        raise ValueError(
            f"--capacity-factor {cfg.capacity_factor}: a capacity drops tokens by how the whole "
            f"batch routes, so an exported model (dropless, as every Hugging Face MoE) would "
            f"compute another function; train dropless (leave --capacity-factor out)"
        )
    if cfg.moe_every and cfg.moe_router.score not in EXPORTED_SCORES:
        raise ValueError(
            f"--router-score {cfg.moe_router.score}: the exported model's code "
            f"(fastpar/models/hf_code/) computes only the scores {EXPORTED_SCORES}; teach it "
            f"this one (docs/contributing.md, 'A new router score') or train with one of those"
        )


def hf_config(cfg: GPTConfig, dtype: str = "float32") -> dict:
    """config.json content for ``cfg`` (``FastparGPTConfig`` with ``auto_map``); no special
    tokens (the exporter sets the run's)."""
    check(cfg)
    return {
        "architectures": ["FastparGPTForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": {
            "AutoConfig": "configuration_fastpar_gpt.FastparGPTConfig",
            "AutoModelForCausalLM": "modeling_fastpar_gpt.FastparGPTForCausalLM",
        },
        **_gpt2_sizes(cfg),
        "norm": cfg.norm,
        "norm_eps": 1e-6 if cfg.norm == "rmsnorm" else 1e-5,  # fastpar.models.common.Norm's
        "moe_every": cfg.moe_every,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_inner": cfg.ffn_size,  # the GPT's experts are as wide as its MLPs
        "router_score": cfg.moe_router.score,
        "normalize_topk": cfg.top_k > 1,  # fastpar's router default
        "routed_scaling_factor": cfg.moe_router.scaling_factor,
        "router_groups": cfg.moe_router.num_groups,
        "router_group_topk": cfg.moe_router.group_topk,
        "group_score_topk": None,  # the config fills in fastpar's default, min(2, per group)
        "expert_bias": cfg.moe_router.expert_bias,
        "shared_expert_ffn": cfg.moe_experts.shared_ffn_hidden_size,
        "shared_expert_gate": cfg.moe_experts.shared_gate,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": dtype,
    }


_BLOCK = re.compile(r"^(\d+)\.(.*)$")


def _name(name: str, layers: int) -> str:
    m = _BLOCK.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a fastpar GPT name (block index first)")
    i, rest = int(m.group(1)), m.group(2)
    if i == 0:
        return {"tok.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight"}[
            rest
        ]
    if i == layers + 1:
        return "lm_head.weight" if rest == "weight" else "transformer.ln_f." + rest.split(".", 1)[1]
    rest = rest.replace("norm1.", "ln_1.").replace("norm2.", "ln_2.")
    return f"transformer.h.{i - 1}.{rest}"


def to_hf(state: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """fastpar global names -> ``FastparGPTForCausalLM``'s (the same modules, renamed; the tied
    head is the embedding). Raises for a name the model does not have or a missing one."""
    check(cfg)
    out: dict[str, torch.Tensor] = {}
    head = f"{cfg.layers + 1}.weight"
    for name, t in state.items():
        if name == head and cfg.tie_embeddings:
            continue  # a pipeline's copy of the tied weight (or the alias): the embedding
        try:
            out[_name(name, cfg.layers)] = t
        except (KeyError, IndexError, ValueError):
            raise ValueError(
                f"to_hf: {name!r} has no name in the exported fastpar GPT; is the config the "
                f"one the model was built with?"
            ) from None
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    for need in ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"):
        if need not in out:
            raise ValueError(f"to_hf: the state dict has no tensor for {need!r}")
    return out


def write_code(out_dir: str) -> None:
    """Copy the model's code (``CODE_FILES``) into ``out_dir``."""
    for name in CODE_FILES:
        shutil.copyfile(os.path.join(CODE_DIR, name), os.path.join(out_dir, name))
