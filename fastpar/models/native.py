"""fastpar's own models, one record each, as ``fastpar.families`` is for Hugging Face ones: what
``python -m fastpar.train --model NAME`` builds, which of the trainer's flags are its own, and
what the trainer, its metrics, summary, checkpoints, optimizers and export ask of a model. Every
consumer reads ``get(name)``; nothing outside ``fastpar/models/`` tests a model by name, so a new
model is one ``register`` (docs/contributing.md, "A new native model")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastpar.models import deepseek_hf, gpt_code, gpt_hf, llama_hf
from fastpar.models.deepseek import DeepSeekConfig, build_deepseek
from fastpar.models.gpt import GPTConfig, build_gpt
from fastpar.models.llama import LlamaConfig, build_llama

MTP_FLAGS = ("mtp_depth", "mtp_loss_coef")
_LLAMA = ("kv_heads", "head_dim", "qk_norm", "attention_bias", "rope_theta", "moe_ffn", *MTP_FLAGS)
_DEEPSEEK_MLA = (
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "first_k_dense",
    "rope_interleave",
    "yarn_factor",
    "yarn_original_seq_len",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
)


@dataclass(frozen=True)
class NativeModel:
    """One of fastpar's own models. ``flags`` reads the trainer's flags object (a
    ``TrainConfig``: its fields are the flags)."""

    name: str
    """``--model NAME``."""
    label: str
    """As messages name it: "GPT", "Llama", "DeepSeek"."""
    config: type
    """Its config class (the shared shape fields plus its own)."""
    build: Callable
    """``build(config, mesh)`` -> its pipeline blocks."""
    flags: tuple[str, ...]
    """The trainer's flags that only some native models take and this one does (another
    model's own flag, changed from its default, is refused naming the models that take it)."""
    kwargs: Callable[[Any], dict]
    """``kwargs(flags)``: its config's own keyword arguments (beyond the shared shape fields)."""
    moe_every: int = 2
    """--moe-every's default: MoE in every N-th block."""
    norms: tuple[str, ...] = ("rmsnorm",)
    """The --norm values it builds."""
    learned_positions: bool = False
    """Positions embedded by index up to --seq-len: a resume must keep --seq-len."""
    per_head_muon: bool = True
    """Its attention weights mark their heads (``--muon-per-head`` applies)."""
    head_dim: Callable[[Any], float] | None = None
    """``head_dim(flags)``: the width attention's FLOPs count per head (default hidden /
    heads)."""
    moe_where: Callable[[Any], str] | None = None
    """``moe_where(flags)``: where its MoE blocks are, in words (default "every N")."""
    exporter: Callable[[Any], tuple] | None = None
    """``exporter(flags)`` -> (the module mapping it to Hugging Face, the dotted name of its own
    HF model class, imported when it exports: it needs transformers; or None); None: it does
    not export."""


REGISTRY: dict[str, NativeModel] = {}
"""--model name -> its record: read through ``get`` / ``names``, changed through ``register``."""


def register(model: NativeModel, *, replace: bool = False) -> NativeModel:
    """Add ``model`` (every consumer sees it at once); an existing name is refused unless
    ``replace``."""
    if model.name in REGISTRY and not replace:
        raise ValueError(f"native model {model.name!r} is already registered; pass replace=True")
    REGISTRY[model.name] = model
    return model


def unregister(name: str) -> NativeModel:
    model = get(name)
    del REGISTRY[name]
    return model


def get(name: str) -> NativeModel:
    """The record of ``--model name``; ValueError naming the registered ones."""
    if name not in REGISTRY:
        *others, last = names()
        raise ValueError(f"--model must be {', '.join(others)} or {last}, got {name!r}")
    return REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def of_config(config) -> NativeModel:
    """The record whose config class ``config`` is; TypeError naming the classes."""
    for model in REGISTRY.values():
        if type(config) is model.config:
            return model
    known = ", ".join(m.config.__name__ for m in REGISTRY.values())
    raise TypeError(f"expected a config of a native model ({known}), got {type(config).__name__}")


def owners(flag: str) -> list[NativeModel]:
    """The native models that take ``flag`` as one of their own."""
    return [m for m in REGISTRY.values() if flag in m.flags]


def own_flags() -> tuple[str, ...]:
    """Every flag some native model takes and another may not, in registration order."""
    seen: dict[str, None] = {}
    for m in REGISTRY.values():
        seen.update(dict.fromkeys(m.flags))
    return tuple(seen)


# -- the three models ------------------------------------------------------------------------
def _gpt_exporter(flags) -> tuple:
    """GPT-2 (``gpt_hf``) when GPT-2 computes the model, else fastpar's own HF code
    (``gpt_code`` with ``FastparGPTForCausalLM``, written beside the weights)."""
    try:
        gpt_hf.check(flags.model())
        return gpt_hf, None
    except ValueError:
        return gpt_code, "fastpar.models.hf_code.modeling_fastpar_gpt.FastparGPTForCausalLM"


def _deepseek_moe_where(flags) -> str:
    every = "" if flags.moe_every == 1 else f" (every {flags.moe_every})"
    return f"after {flags.first_k_dense} dense{every}"  # DeepSeek-V2's moe_layer_freq


register(
    NativeModel(
        name="gpt",
        label="GPT",
        config=GPTConfig,
        build=build_gpt,
        flags=(),
        kwargs=lambda f: {"norm": f.norm},
        norms=("rmsnorm", "layernorm"),
        learned_positions=True,
        exporter=_gpt_exporter,
    )
)
register(
    NativeModel(
        name="llama",
        label="Llama",
        config=LlamaConfig,
        build=build_llama,
        flags=_LLAMA,
        kwargs=lambda f: {n: getattr(f, n) for n in _LLAMA},
        head_dim=lambda f: f.head_dim or f.hidden / f.heads,
        exporter=lambda f: (llama_hf, None),
    )
)
register(
    NativeModel(
        name="deepseek",
        label="DeepSeek",
        config=DeepSeekConfig,
        build=build_deepseek,
        flags=("rope_theta", "moe_ffn", *MTP_FLAGS, "q_lora_rank", *_DEEPSEEK_MLA),
        kwargs=lambda f: {
            "q_lora_rank": f.q_lora_rank or None,
            **{n: getattr(f, n) for n in ("rope_theta", "moe_ffn", *MTP_FLAGS, *_DEEPSEEK_MLA)},
        },
        moe_every=1,
        per_head_muon=False,
        # attention's scores over the q/k head, the values' sum over v's
        head_dim=lambda f: (f.qk_nope_head_dim + f.qk_rope_head_dim + f.v_head_dim) / 2,
        moe_where=_deepseek_moe_where,
        exporter=lambda f: (deepseek_hf, None),
    )
)
