"""``parallelize``: make a plain PyTorch transformer tensor-parallel by a plan, without rewriting it.

    plan = {
        "transformer.wte": "vocab",
        "*.attn.c_attn": ("column", {"fused": 3}),   # fused q|k|v: split each block by heads
        "*.attn.c_proj": "row",
        "*.mlp.c_fc": "column",
        "*.mlp.c_proj": "row",
        "lm_head": ("column", {"gather_output": True}),
    }
    model = fastpar.parallelize(model, plan, mesh)   # or group=...

Patterns are ``fnmatch`` patterns over ``model.named_modules()`` names; styles are "column",
"row" and "vocab", optionally with keyword arguments for the fastpar layer. Attention modules
that own a column-parallel projection keep fewer heads per rank: their head-count attributes
(``num_heads``, ``n_head``, ``num_attention_heads``, ``num_key_value_heads``, ``n_kv_head``, or
those named in ``heads=``) are divided by the TP size, and a count not divisible by it is an
error. Parameters tied before (an embedding and its LM head) are tied again afterwards.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch.distributed as dist
from torch import nn

from fastpar.comm import group_size
from fastpar.nn.embedding import VocabParallelEmbedding
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear, resolve_group

HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_head")
_STYLES = {
    "column": ColumnParallelLinear,
    "row": RowParallelLinear,
    "vocab": VocabParallelEmbedding,
}
_EXPECTS = {"column": nn.Linear, "row": nn.Linear, "vocab": nn.Embedding}


def _parse_style(pattern: str, style) -> tuple[str, dict]:
    name, kwargs = (style, {}) if isinstance(style, str) else style
    if name not in _STYLES:
        raise ValueError(f"plan[{pattern!r}] = {style!r}: style must be one of {sorted(_STYLES)}")
    return name, dict(kwargs)


def _divide_heads(module: nn.Module, name: str, attrs, world: int) -> None:
    for attr in attrs:
        value = getattr(module, attr, None)
        if not isinstance(value, int):
            continue
        if value % world:
            raise ValueError(
                f"module {name!r} has {attr}={value}, not divisible by the tensor-parallel size "
                f"{world}: attention heads cannot be split evenly; use a TP size that divides {value}"
            )
        setattr(module, attr, value // world)


def parallelize(
    model: nn.Module,
    plan: Mapping[str, object],
    mesh=None,
    *,
    group: dist.ProcessGroup | None = None,
    heads: Mapping[str, list[str]] | None = None,
) -> nn.Module:
    """Swap the modules named by ``plan`` for their fastpar twins, in place; returns ``model``.

    ``heads`` maps module-name patterns to extra integer attributes to divide by the TP size
    (say ``{"*.attn": ["n_head", "n_embd"]}`` for nanoGPT, whose attention reshapes with
    ``n_embd``). Every rank must call this with identical weights (same seed or checkpoint).
    A pattern that matches nothing is an error (a typo would otherwise leave a layer dense).
    """
    tp_group = resolve_group(group, mesh)
    world = group_size(tp_group)
    names = dict(model.named_modules())
    chosen: dict[str, tuple[str, dict]] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        parsed = _parse_style(pattern, style)
        for n in hits:
            if n in chosen and chosen[n] != parsed:
                raise ValueError(
                    f"module {n!r} is matched by two plan entries with different styles"
                )
            chosen[n] = parsed

    # remember which parameters were shared before swapping (tied embedding / LM head)
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in names.items():
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, p_name))

    new_modules: dict[str, nn.Module] = {}
    for n, (style, kwargs) in chosen.items():
        old = names[n]
        if type(old) is not _EXPECTS[style]:
            raise TypeError(
                f"plan style {style!r} needs an {_EXPECTS[style].__name__} at {n!r}, found "
                f"{type(old).__name__}"
            )
        new = _STYLES[style].from_dense(old, group=tp_group, **kwargs)
        parent_name, _, attr = n.rpartition(".")
        setattr(names[parent_name] if parent_name else model, attr, new)
        new_modules[n] = new

    # attention heads: divide the head counts of modules that own a column-parallel projection
    parents = {n.rpartition(".")[0] for n, (style, _) in chosen.items() if style == "column"}
    for n in sorted(parents):
        module = names[n] if n else model
        extra = [
            a for pat, attrs in (heads or {}).items() if fnmatch.fnmatchcase(n, pat) for a in attrs
        ]
        _divide_heads(module, n, (*HEAD_ATTRS, *dict.fromkeys(extra)), world)
    for pat in heads or {}:
        if not any(fnmatch.fnmatchcase(n, pat) for n in parents):
            raise ValueError(
                f"heads pattern {pat!r} matches no module that owns a column projection"
            )

    def _module(name: str) -> nn.Module:
        return new_modules[name] if name in new_modules else names[name]

    # re-tie parameters that were one tensor before
    for shared in owners.values():
        if len(shared) < 2:
            continue
        current = [getattr(_module(m), p) for m, p in shared]
        first = current[0]
        for (m, p), t in zip(shared[1:], current[1:], strict=True):
            if t is first:
                continue
            if t.shape != first.shape:
                raise ValueError(
                    f"{m}.{p} was tied to {shared[0][0]}.{shared[0][1]} but their sharded shapes "
                    f"differ ({tuple(t.shape)} vs {tuple(first.shape)}); shard both the same way"
                )
            setattr(_module(m), p, first)
    return model
