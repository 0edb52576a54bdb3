"""LoRA adapters in Hugging Face PEFT's files, both ways (docs/lora.md): ``save_peft`` writes
``adapter_config.json`` and ``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` does
(keys ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``, the split factors
gathered whole to rank 0), ``load_peft`` puts such a directory's adapters on a model of any
tensor-parallel layout (each rank takes its part). fastpar never imports peft; safetensors is
imported when first needed."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from fastpar.checkpoint.gather import gather_state
from fastpar.checkpoint.state import localize
from fastpar.comm import plain
from fastpar.mesh.ranks import group_size
from fastpar.nn.linear import is_conv1d
from fastpar.nn.lora import (
    LoRALinear,
    check_dropout,
    check_factor,
    check_rank,
    features,
    layout_kind,
    lora_modules,
)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")


def _uniform(mods: list[tuple[str, LoRALinear]], what: str, get) -> float:
    values = {get(m) for _, m in mods}
    if len(values) > 1:
        odd = next(n for n, m in mods if get(m) != get(mods[0][1]))
        raise ValueError(
            f"save_peft: {what} differs between adapters ({sorted(values)}, e.g. at {odd!r}); "
            f"PEFT's file here takes one value: give every adapter the same {what}"
        )
    return values.pop()


def _target_modules(model: nn.Module, names: list[str]) -> list[str]:
    """The wrapped modules' own names when those name no other linear layer (PEFT's usual
    ``["q_proj", "v_proj"]``), else their full names."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    others = [
        n
        for n, m in model.named_modules()
        if n not in names
        and n.rsplit(".", 1)[-1] in leaves
        and not isinstance(m, LoRALinear)
        and not any(n.startswith(w + ".") for w in names)
    ]
    return sorted(names) if others else leaves


def _weight_in_out(base: nn.Module) -> bool:
    """A Conv1D-layout base ([in, out] weight): PEFT's fan_in_fan_out."""
    return is_conv1d(base) or bool(getattr(base, "transposed", False))


def peft_config(model: nn.Module, task_type: str | None = "CAUSAL_LM") -> dict:
    """The ``adapter_config.json`` of ``model``'s adapters (one rank, alpha and dropout);
    ``task_type``: PEFT's (``PeftModel.from_pretrained`` picks its model class by it)."""
    mods = list(lora_modules(model))
    if not mods:
        raise ValueError("save_peft: the model has no LoRA adapters; apply_lora first")
    drop = lambda m: getattr(m.lora_dropout, "p", 0.0)  # noqa: E731
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": None,
        "r": _uniform(mods, "rank", lambda m: m.r),
        "lora_alpha": _uniform(mods, "alpha", lambda m: m.alpha),
        "lora_dropout": _uniform(mods, "dropout", drop),
        "target_modules": _target_modules(model, [n for n, _ in mods]),
        "bias": "none",
        "fan_in_fan_out": any(_weight_in_out(m.base_layer) for _, m in mods),
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_bias": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    task_type: str | None = "CAUSAL_LM",
    dst: int = 0,
) -> None:
    """Write ``model``'s adapters to ``directory`` as PEFT does, on global rank ``dst``
    (collective over the default group: every rank calls it; the split factors are gathered
    whole). ``peft.PeftModel.from_pretrained(base, directory)`` then computes what ``model``
    does, ``base`` being the model without adapters."""
    config = peft_config(model, task_type)
    named = {}
    for name, m in lora_modules(model):
        named[f"{PREFIX}{name}.lora_A.weight"] = m.lora_A  # the parameter: its layout mark
        named[f"{PREFIX}{name}.lora_B.weight"] = m.lora_B
    whole = gather_state(named, dst=dst)
    if whole is not None:
        st = _safetensors()
        os.makedirs(directory, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in sorted(whole.items())}
        st.save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    if group_size(None) > 1:
        plain.barrier()


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - the hf extra installs it
        raise ImportError("PEFT files need safetensors: pip install fastpar[hf]") from e
    return st


_REFUSED = {
    "use_dora": "DoRA",
    "use_rslora": "rsLoRA's alpha/sqrt(r) scaling",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
}


def _read(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS_NAME)):
        raise ValueError(
            f"load_peft: {os.fspath(directory)!r} lacks {CONFIG_NAME} or {WEIGHTS_NAME}; pass a "
            f"directory PEFT's save_pretrained (or save_peft) wrote"
        )
    with open(path) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"load_peft: {path} holds a {config.get('peft_type')} adapter; only LORA is supported"
        )
    for key, what in _REFUSED.items():
        if config.get(key):
            raise ValueError(f"load_peft: {path} uses {what}; not supported: save it without")
    tensors = _safetensors().load_file(os.path.join(directory, WEIGHTS_NAME))
    return config, tensors


def _by_module(tensors: dict[str, torch.Tensor], path: str) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        suffix = next((s for s in _FACTORS if key.endswith(s)), None)
        if not key.startswith(PREFIX) or suffix is None:
            raise ValueError(
                f"load_peft: {path} holds {key!r}, not a LoRA factor "
                f"'{PREFIX}<module>.lora_A.weight' / '.lora_B.weight'; save it without"
            )
        module = key[len(PREFIX) : -len(suffix)]
        out.setdefault(module, {})[suffix[1:7]] = t
    for module, factors in out.items():
        if len(factors) != 2:
            raise ValueError(f"load_peft: {path} has only one factor of {module!r}; re-save it")
    return out


def _pattern(patterns: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key ``name`` ends with."""
    for key, value in patterns.items():
        if name == key or name.endswith("." + key):
            return value
    return default


def load_peft(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    freeze: bool = True,
) -> list[str]:
    """Put the PEFT adapters of ``directory`` on ``model`` (plain, or ``parallelize``'d: every
    rank reads the file and keeps its part) and return the modules' names. A module already
    wrapped by ``apply_lora`` takes the values (its rank and alpha must match); any other is
    wrapped. With ``freeze`` every other parameter is frozen. Every check runs before the model
    changes: an unknown module, a factor whose shape does not fit the base (an adapter for
    another base), a rank over the base's dimensions: a one-line ValueError naming the module."""
    path = os.path.join(directory, CONFIG_NAME)
    config, tensors = _read(directory)
    plan = []
    dropout = float(config.get("lora_dropout") or 0.0)
    for name, f in _by_module(tensors, path).items():
        try:
            m = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"load_peft: the adapter names module {name!r}, which the model lacks; load it "
                f"onto the base model it was made for"
            ) from None
        base = m.base_layer if isinstance(m, LoRALinear) else m
        layout_kind(base, name)
        r = _pattern(config.get("rank_pattern") or {}, name, config.get("r", f["lora_A"].shape[0]))
        alpha = _pattern(config.get("alpha_pattern") or {}, name, config.get("lora_alpha", r))
        in_f, out_f = features(base)
        check_rank(name, r, in_f, out_f)
        check_dropout(name, dropout)
        check_factor(name, "lora_A", f["lora_A"], (r, in_f))
        check_factor(name, "lora_B", f["lora_B"], (out_f, r))
        if isinstance(m, LoRALinear) and (m.r, m.alpha) != (r, alpha):
            raise ValueError(
                f"load_peft: {name!r} has an adapter of rank {m.r}, alpha {m.alpha}; the file's "
                f"is rank {r}, alpha {alpha}: load onto a model without adapters there"
            )
        plan.append((name, m, r, alpha, f))
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    for name, m, r, alpha, f in plan:
        if isinstance(m, LoRALinear):
            with torch.no_grad():
                for which in ("lora_A", "lora_B"):
                    p = getattr(m, which)
                    p.copy_(localize(f[which], p))
                    p.requires_grad_(True)
            continue
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lora = LoRALinear(
            m, r, alpha, dropout, lora_A=f["lora_A"], lora_B=f["lora_B"], dtype=dtype, name=name
        )
        setattr(owner, leaf, lora)
    return [name for name, *_ in plan]
