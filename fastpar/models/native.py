"""fastpar's own models, one record each, as ``fastpar.families`` is for Hugging Face ones: what
``python -m fastpar.train --model NAME`` builds, which of the trainer's flags are its own, and
what the trainer, its metrics, summary, checkpoints, optimizers and export ask of a model. Every
consumer reads ``get(name)``; nothing outside ``fastpar/models/`` tests a model by name, so a new
model is one ``register`` (docs/contributing.md, "A new native model")."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastpar.cliutil import Flag, declared_flags, lenient, nested_configs
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
    """One of fastpar's own models. Its config class declares its flags (``model_flags``);
    the callables below take an instance of it (``TrainConfig.model``)."""

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
    moe_every: int = 2
    """--moe-every's default: MoE in every N-th block."""
    norms: tuple[str, ...] = ("rmsnorm",)
    """The --norm values it builds."""
    learned_positions: bool = False
    """Positions embedded by index up to --seq-len: a resume must keep --seq-len."""
    per_head_muon: bool = True
    """Its attention weights mark their heads (``--muon-per-head`` applies)."""
    head_dim: Callable[[Any], float] | None = None
    """``head_dim(config)``: the width attention's FLOPs count per head (default hidden / heads)."""
    moe_where: Callable[[Any], str] | None = None
    """``moe_where(config)``: where its MoE blocks are, in words (default "every N")."""
    exporter: Callable[[Any], tuple] | None = None
    """``exporter(config)`` -> (the module mapping it to Hugging Face, the dotted name of its own
    HF model class, imported when it exports: it needs transformers; or None); None: it does
    not export."""


REGISTRY: dict[str, NativeModel] = {}
"""--model name -> its record: read through ``get``, changed through ``register``."""


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
        *others, last = REGISTRY
        raise ValueError(f"--model must be {', '.join(others)} or {last}, got {name!r}")
    return REGISTRY[name]


def of_config(config) -> NativeModel:
    """The record whose config class ``config`` is; TypeError naming the classes."""
    for model in REGISTRY.values():
        if type(config) is model.config:
            return model
    known = ", ".join(m.config.__name__ for m in REGISTRY.values())
    raise TypeError(f"expected a config of a native model ({known}), got {type(config).__name__}")


# -- the model flags: the registered config classes' option fields, each declared once ----------
_FLAGS: dict[tuple, dict[str, Flag]] = {}


def model_flags() -> dict[str, Flag]:
    """Flat name -> ``Flag`` of every registered model config's flags (``option`` fields of
    ``DecoderShape``, ``SwiGLUShape``, a model's own class, or of the ``RouterConfig`` /
    ``ExpertConfig`` it holds as ``moe_router`` / ``moe_experts``; the union: a field shared
    through inheritance is one flag), in registration and declaration order."""
    key = tuple(m.config for m in REGISTRY.values())
    if key not in _FLAGS:
        out: dict[str, Flag] = {}
        for config in key:
            held = [declared_flags(inner, (h,)) for h, inner in nested_configs(config)]
            for flag in sum(held, declared_flags(config)):
                out.setdefault(flag.name, flag)
        _FLAGS[key] = out
    return _FLAGS[key]


def _takes(model: NativeModel, flag: Flag, some: tuple[str, ...]) -> bool:
    """Whether ``model``'s config holds ``flag`` (one of ``some``, the flags some native model
    takes as its own, only where it is one of ``model.flags``)."""
    names = {f.name for f in dataclasses.fields(model.config)}
    return (flag.name not in some or flag.name in model.flags) and flag.path[0] in names


def config_from_flags(model_type: str, values: dict, **fixed) -> tuple[Any, dict]:
    """(the config of ``--model model_type`` from the flags' ``values`` (flat names; a flag
    left out: its default; a deferred one None: the record's), the values of the flags its
    config has no field for that are not at their defaults). ``fixed``: its config's other
    fields (``vocab_size``). An unknown model: (None, every value given)."""
    flags = model_flags()
    if model_type not in REGISTRY:
        return None, {n: v for n, v in values.items() if n in flags}
    model = REGISTRY[model_type]
    top: dict = dict(fixed)
    inner: dict[str, dict] = {}
    other = {}
    some = own_flags()  # (a model's fields for others' flags keep its config's defaults)
    for name, flag in flags.items():
        value = values.get(name, flag.default)
        if name == "moe_every" and value is None:
            value = model.moe_every
        if not _takes(model, flag, some):
            if value != flag.default:
                other[name] = value
        elif len(flag.path) == 1:
            top[flag.path[0]] = flag.option.to_field(value)
        else:
            inner.setdefault(flag.path[0], {})[flag.path[1]] = flag.option.to_field(value)
    base = model.config()
    for holder, kw in inner.items():
        held = getattr(base, holder)
        top[holder] = lenient(type(held), **{**dataclasses.asdict(held), **kw})
    return lenient(model.config, **top), other


def flags_of(config, other: dict | None = None) -> dict:
    """The flags' values of a native model's ``config`` (flat name -> value as the flag says it); a
    flag it does not take (``config_from_flags``): ``other``'s value, else its default."""
    out = {}
    model = of_config(config) if config is not None else None
    some = own_flags()
    for name, flag in model_flags().items():
        if model is not None and _takes(model, flag, some):
            out[name] = flag.option.to_flag(functools.reduce(getattr, flag.path, config))
        else:
            out[name] = (other or {}).get(name, flag.default)
    return out


def own_flags() -> tuple[str, ...]:
    """Every flag some native model takes and another may not, in registration order."""
    return tuple(dict.fromkeys(name for m in REGISTRY.values() for name in m.flags))


# -- the three models ------------------------------------------------------------------------
def _gpt_exporter(config: GPTConfig) -> tuple:
    """GPT-2 (``gpt_hf``) when GPT-2 computes the model, else fastpar's own HF code
    (``gpt_code`` with ``FastparGPTForCausalLM``, written beside the weights)."""
    try:
        gpt_hf.check(config)
        return gpt_hf, None
    except ValueError:
        return gpt_code, "fastpar.models.hf_code.modeling_fastpar_gpt.FastparGPTForCausalLM"


register(
    NativeModel(
        name="gpt",
        label="GPT",
        config=GPTConfig,
        build=build_gpt,
        flags=("norm",),
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
        head_dim=lambda c: c.head_dim or c.hidden / c.heads,
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
        moe_every=1,
        per_head_muon=False,
        # attention's scores over the q/k head, the values' sum over v's
        head_dim=lambda c: (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2,
        moe_where=lambda c: (
            f"after {c.first_k_dense} dense"  # DeepSeek-V2's moe_layer_freq
            + ("" if c.moe_every == 1 else f" (every {c.moe_every})")
        ),
        exporter=lambda f: (deepseek_hf, None),
    )
)
