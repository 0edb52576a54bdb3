"""The float64 run of ``parallelize``'s check: ``promoted`` holds a model's floating values in
float64 for its duration (put back bit for bit), its plain embedding tables looked up row by
row (``Rows``: the table's gradient as the rows read, the same values as a promoted table's
and a fraction of its memory); ``configs_kept`` puts the model's ``config`` objects
back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastpar import tolerance


class configs_kept:
    """Within it, the model's ``config`` objects may change; their attributes are put back on
    exit."""

    def __init__(self, model: nn.Module):
        self.saved = {}
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "__dict__") and id(cfg) not in self.saved:
                self.saved[id(cfg)] = (cfg, dict(vars(cfg)))

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        for cfg, attrs in self.saved.values():
            vars(cfg).clear()
            vars(cfg).update(attrs)


@dataclass
class Rows:
    """A table's gradient that is zero but on some rows: ``values[i]`` added at row
    ``index[i]`` (an index may repeat) of a table of ``shape``."""

    index: torch.Tensor
    values: torch.Tensor
    shape: tuple

    def part(self, lo: int, n: int) -> torch.Tensor:
        """Rows ``lo`` to ``lo + n`` of the table, dense (rows past its end zero)."""
        keep = (self.index >= lo) & (self.index < lo + n)
        out = self.values.new_zeros((n, *self.shape[1:]))
        return out.index_add_(0, self.index[keep] - lo, self.values[keep])


class promoted:
    """Within it, every floating parameter and buffer of ``model`` holds its own values
    promoted to float64 (and an HF MoE block its eager experts path: ``tolerance.cast``); the
    original tensors, gradients and configs are put back on exit, bit for bit. An embedding
    table of its own (``compact_tables``) stays as it is: each lookup promotes the rows it
    reads, the same values, and ``row_grads`` gives the table's float64 gradient as those
    rows'."""

    def __init__(self, model: nn.Module, compact: bool = True, whole=frozenset()):
        self.model, self.saved = model, []
        self.configs = configs_kept(model)
        self.compact = compact_tables(model, whole) if compact else {}
        self.rows: dict[str, list] = {name: [] for name in self.compact}

    def __enter__(self) -> None:
        tables = {id(m.weight) for m in self.compact.values()}
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                if t.is_floating_point() and id(t) not in tables:
                    self.saved.append((t, t.data, t.grad))
                    t.grad = None
                    t.data = t.data.to(torch.float64)
        for name, m in self.compact.items():
            m.forward = _lookup(m, self.rows[name])
        tolerance.eager_experts(self.model)
        return self

    def row_grads(self) -> dict[str, Rows]:
        """{name of a compact table: its float64 gradient, as the rows it looked up}."""
        out = {}
        for name, runs in self.rows.items():
            runs = [(ids, rows.grad) for ids, rows in runs if rows.grad is not None]
            if runs:
                ids, grads = torch.cat([i for i, _ in runs]), torch.cat([g for _, g in runs])
                out[name] = Rows(ids, grads, tuple(self.compact[name].weight.shape))
        return out

    def __exit__(self, *exc) -> None:
        for m in self.compact.values():
            del m.forward
        for t, data, grad in self.saved:
            t.data = data
            t.grad = grad
        self.configs.__exit__(*exc)


def compact_tables(model: nn.Module, whole=frozenset()) -> dict[str, nn.Embedding]:
    """{parameter name: its ``nn.Embedding``} for the plain tables the float64 run looks up
    row by row instead of promoting whole: nn.Embedding's own forward, no max_norm, a weight
    no other module holds (a tied head multiplies by all of it) and whose id is not in
    ``whole`` (a parameter the probe watches: it must meet its ops itself)."""
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    out = {}
    for name, m in model.named_modules():
        if (
            type(m).forward is nn.Embedding.forward
            and "forward" not in vars(m)
            and m.max_norm is None
            and m.weight.is_floating_point()
            and holders.get(id(m.weight)) == 1
            and id(m.weight) not in whole
        ):
            out[f"{name}.weight" if name else "weight"] = m
    return out


def _lookup(m: nn.Embedding, sink: list):
    """``m``'s forward over float64 copies of the rows ``ids`` read (kept in ``sink`` with the
    ids: their gradient is the table's); the same values as a lookup in a promoted table."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows = m.weight.detach().index_select(0, uniq.reshape(-1)).to(torch.float64)
        rows.requires_grad_(m.weight.requires_grad and torch.is_grad_enabled())
        sink.append((uniq.reshape(-1), rows))
        pad = None
        if m.padding_idx is not None and bool((hit := uniq == m.padding_idx).any()):
            pad = int(hit.nonzero()[0, 0])
        return F.embedding(inv, rows, pad, None, m.norm_type, m.scale_grad_by_freq)

    return forward


def tree_map_float(inputs, dtype):
    """(args, kwargs) with their floating tensors cast to ``dtype`` (token ids stay)."""

    def cast(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        return v

    args, kwargs = inputs
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
