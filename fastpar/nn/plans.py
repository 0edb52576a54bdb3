"""Built-in tensor-parallel plans for Hugging Face model families, chosen by the model's
``config.model_type`` (``fastpar.families``); how they are found and what each splits: docs/hf.md
("parallelize: built-in plans or your own").
"""

from __future__ import annotations

from torch import nn

from fastpar import families


def model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def builtin_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, object] | None:
    """The built-in plan for ``model``'s family (``fastpar.families``), or None if there is
    none."""
    family = families.find(model_type(model))
    template = None if family is None else family.plan
    if template is None:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    head = ("column", {"pad_output": True, "gather_output": not loss_parallel})
    plan: dict[str, object] = {}
    for pattern, style in template.items():
        if style == "lm_head":
            style = head
        elif not isinstance(style, str):
            style = (style[0], {k: _config_value(model, v) for k, v in style[1].items()})
        plan[pattern.format(b=base)] = style
    return plan


def _config_value(model: nn.Module, value):
    """A template option ``"config.NAME"`` is the model config's ``NAME`` (DeepSeek-V3's
    ``qk_rope_head_dim``); any other value is itself."""
    if not (isinstance(value, str) and value.startswith("config.")):
        return value
    key = value.removeprefix("config.")
    found = getattr(getattr(model, "config", None), key, None)
    if found is None:
        raise ValueError(
            f"built-in plan option {value!r}: {type(model).__name__}'s config has no {key!r}"
        )
    return found


def supported() -> str:
    """The families with a built-in plan, comma-separated."""
    return ", ".join(families.names("plan"))
