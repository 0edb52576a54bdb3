"""A tensor-parallel plan: its styles, how patterns pick modules, and the checks made before
anything is swapped (style fits the module type, projections of one block split together, head
counts from the module or its ``config`` divide the TP size)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from fastpar.nn import styles
from fastpar.nn.styles import linear_like

HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_head")
WIDTH_ATTRS = ("split_size", "all_head_size")
"""Widths of the split projections that attention modules reshape with (GPT-2, BERT)."""
CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads", "n_head")


def parse_style(pattern: str, style) -> tuple[str, dict]:
    name, kwargs = (style, {}) if isinstance(style, str) else style
    record = styles.get(name, f"plan[{pattern!r}] = {style!r}: ")
    kwargs = dict(kwargs)
    if not record.options and kwargs:
        raise ValueError(f"plan[{pattern!r}]: style {name!r} takes no keyword arguments")
    for bad in ("group", "mesh"):
        if bad in kwargs:
            raise ValueError(f"plan[{pattern!r}]: pass {bad}= to parallelize, not in the plan")
    if kwargs.get("sequence_parallel"):
        raise ValueError(
            f"plan[{pattern!r}]: sequence_parallel is not supported by parallelize: the model's "
            "own norms, dropout and residuals would have to act on sequence shards; use the "
            "fastpar models (fastpar.models) for sequence parallelism"
        )
    return name, kwargs


def splits_output(style: str, kwargs: dict) -> bool:
    return styles.get(style).splits_output(kwargs)


def match(model: nn.Module, plan: Mapping[str, object], strict: bool) -> dict[str, tuple]:
    names = [n for n, _ in model.named_modules() if n]
    chosen: dict[str, tuple[str, dict]] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and strict:
            raise ValueError(
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        parsed = parse_style(pattern, style)
        for n in hits:
            if n in chosen and chosen[n] != parsed:
                raise ValueError(
                    f"module {n!r} is matched by two plan entries with different styles"
                )
            chosen[n] = parsed
    return chosen


def head_counts(module: nn.Module, model: nn.Module) -> dict[str, int]:
    counts = {a: v for a in HEAD_ATTRS if isinstance(v := getattr(module, a, None), int)}
    config = getattr(module, "config", None) or getattr(model, "config", None)
    for key in CONFIG_HEADS:
        value = getattr(config, key, None)
        if isinstance(value, int) and f"config.{key}" not in counts:
            counts[f"config.{key}"] = value
    return counts


def static_checks(model, modules, chosen, world, heads) -> list[str]:
    """Types, siblings and head counts. Returns the names of the attention-like parents."""
    for n, (style, _) in chosen.items():
        styles.get(style).check(n, modules[n], style)
    split_parents = sorted(
        {n.rpartition(".")[0] for n, (s, kw) in chosen.items() if splits_output(s, kw)}
    )
    for parent in split_parents:
        module = modules[parent] if parent else model
        prefix = f"{parent}." if parent else ""
        dense = [
            prefix + c
            for c, m in module.named_children()
            if linear_like(m) and prefix + c not in chosen
        ]
        if dense:
            split = [prefix + c for c, _ in module.named_children() if prefix + c in chosen]
            raise ValueError(
                f"plan splits {split} but leaves {dense} in the same module {parent or '<model>'!r} "
                f"dense: the projections of one attention/MLP block must be split together (plan "
                f"{dense} as 'column' like the others, the output projection as 'row'), or "
                f"mark them 'replicate' if they really see whole activations"
            )
    attention = []
    for parent in split_parents:
        module = modules[parent] if parent else model
        if not (
            any(isinstance(getattr(module, a, None), int) for a in HEAD_ATTRS)
            or "attention" in type(module).__name__.lower()
            or "attn" in parent.rpartition(".")[2].lower()
        ):
            continue
        attention.append(parent)
        for what, value in head_counts(module, model).items():
            if value % world:
                divisors = [d for d in range(1, value + 1) if value % d == 0]
                raise ValueError(
                    f"module {parent!r} has {what}={value}, not divisible by the tensor-parallel "
                    f"size {world}: attention heads cannot be split evenly; use a TP size in "
                    f"{divisors}"
                )
    for pat in heads or {}:
        if not any(fnmatch.fnmatchcase(n, pat) for n in split_parents):
            raise ValueError(
                f"heads pattern {pat!r} matches no module that owns a column projection"
            )
    return attention
