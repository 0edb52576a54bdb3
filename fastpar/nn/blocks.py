"""Which blocks of a repeated stack ``parallelize``'s probe and check run: the first child of
each kind of an ``nn.ModuleList`` (``distinct_blocks``), the others left out meanwhile
(``only``), and what was found for a kept child mapped to its copies (``to_copies``;
docs/hf.md, "The check")."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

_SIMPLE = (int, float, bool, str, type(None))


def _simple_attrs(module: nn.Module) -> dict[str, object]:
    """The plain values a module keeps (head counts, a sliding window, a flag): what may make
    two blocks with equal parameters compute otherwise."""
    out = {}
    for k, v in vars(module).items():
        if k.startswith("_") or k == "training":
            continue
        if isinstance(v, _SIMPLE) or (
            isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v)
        ):
            out[k] = v
        elif callable(v) and not isinstance(v, (nn.Module, torch.Tensor, type)):
            # a function kept as an attribute (an activation): by name, else by identity
            qual = getattr(v, "__qualname__", None)
            out[k] = (getattr(v, "__module__", None), qual) if qual else ("id", id(v))
    return out


def _numbers(values: list) -> bool:
    """Whether ``values`` (one per child, in order) number the children: n, n + 1, ..."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    return ints and values == list(range(values[0], values[0] + len(values)))


def distinct_blocks(model: nn.Module, chosen: Mapping[str, tuple]) -> dict[str, dict[str, str]]:
    """{name of an outermost ``nn.ModuleList``: {child's key: the key of the first child of its
    kind}} for the lists whose children repeat. Two children are of a kind when they have the
    same class, submodules, parameter shapes and dtypes, buffers (values too), planned styles
    and plain attributes (values, tuples of them, functions; one that numbers the children,
    as ``layer_idx``, left out). The probe and the
    check run on the first child of each kind only (``only``); what the probe finds for it
    holds for its copies (``to_copies``)."""
    out: dict[str, dict[str, str]] = {}
    inside: list[str] = []
    for name, lst in model.named_modules():
        if not isinstance(lst, nn.ModuleList) or len(lst) < 2:
            continue
        if any(name == p or name.startswith(p + ".") for p in inside):
            continue  # inside a list already considered (experts inside a block: all kept)
        inside.append(name)
        children = list(lst._modules.items())
        attrs = {
            k: {(rel, a): v for rel, m in c.named_modules() for a, v in _simple_attrs(m).items()}
            for k, c in children
        }
        keys = set().union(*(a.keys() for a in attrs.values()))
        numbering = {  # an attribute that counts the children (layer_idx): not their kind
            key for key in keys if _numbers([a.get(key) for a in attrs.values()])
        }
        first: dict = {}  # kind -> [(key, buffers)] of the first child of each kind
        rep = {}
        for k, c in children:
            prefix = f"{name}.{k}" if name else k
            kind = (
                type(c),
                tuple((rel, type(m)) for rel, m in c.named_modules()),
                tuple(
                    (rel, tuple(p.shape), p.dtype, p.requires_grad)
                    for rel, p in c.named_parameters(remove_duplicate=False)
                ),
                tuple((rel, tuple(b.shape), b.dtype) for rel, b in c.named_buffers()),
                tuple(
                    (n[len(prefix) :], repr(style))
                    for n, style in chosen.items()
                    if n == prefix or n.startswith(prefix + ".")
                ),
                tuple(
                    sorted(
                        (repr(key), repr(v)) for key, v in attrs[k].items() if key not in numbering
                    )
                ),
            )
            buffers = [b for _, b in c.named_buffers()]
            same = [  # equal buffer values too (a per-block table of numbers)
                r
                for r, theirs in first.get(kind, [])
                if all(torch.equal(a, b) for a, b in zip(buffers, theirs, strict=True))
            ]
            if not same:
                first.setdefault(kind, []).append((k, buffers))
            rep[k] = same[0] if same else k
        if len(set(rep.values())) < len(children):
            out[name] = rep
    return out


def to_copies(names, blocks: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """{name: the name it stands for}: each of ``names`` under a kept child of ``blocks``, and
    the same name under each copy of that child."""
    out = {n: n for n in names}
    for lst, rep in blocks.items():
        for key, first in rep.items():
            if key == first:
                continue
            head, other = f"{lst}.{first}" if lst else first, f"{lst}.{key}" if lst else key
            for n in names:
                if n == head or n.startswith(head + "."):
                    out[other + n[len(head) :]] = n
    return out


class only:
    """Within it, each ``nn.ModuleList`` named in ``blocks`` (``distinct_blocks``) holds only
    the first child of each kind, under its own key (parameter names unchanged); restored on
    exit."""

    def __init__(self, model: nn.Module, blocks: Mapping[str, Mapping[str, str]]):
        self.model, self.blocks, self.saved = model, blocks, []

    def __enter__(self) -> None:
        modules = dict(self.model.named_modules())
        for name, keep in self.blocks.items():
            lst = modules[name]
            self.saved.append((lst, lst._modules))
            lst._modules = {k: v for k, v in lst._modules.items() if keep.get(k) == k}

    def __exit__(self, *exc) -> None:
        for lst, children in self.saved:
            lst._modules = children
        self.saved.clear()
