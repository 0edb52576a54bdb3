"""The routed experts' GEMMs in fp8 (issue 47; docs/kernels.md, "fp8 linear layers"): each
expert's two matrices run through ``fastpar.ops.fp8_linear`` on that expert's token block, so
every scale is per expert, as Megatron-Core / Transformer Engine scale each GEMM of a grouped
GEMM (tensorwise: one for the expert's weight, one for its token block, one for its output
gradient). Experts run one after another: torch's fp8 grouped GEMM
(``torch._scaled_grouped_mm``) has no CPU kernel and no blockwise form, so the per-expert loop is
the emulation of a grouped fp8 GEMM on every device. An expert with no tokens skips its GEMMs
(its weights get a zero gradient); the Function pads each block's tokens to the recipe's multiple.

Under expert TP (``fastpar.moe.tp``) ``w1`` is split like a column-parallel layer and ``w2``
like a row-parallel one, so they take ``column_splits`` / ``row_splits`` over the TP group: each
scale is the one a single device holding the whole expert computes. Every TP rank holds the
same tokens, so every rank skips the same experts and the amax reductions pair up."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastpar.moe.experts import hidden
from fastpar.ops.fp8_linear import (
    ONE_DEVICE,
    Fp8Splits,
    Fp8Use,
    column_splits,
    fp8_linear,
    row_splits,
)


class ExpertsFp8(NamedTuple):
    """The experts' fp8: the recipe, and the splits of the first (``w1``) and second (``w2``)
    matrices on this rank."""

    use: Fp8Use
    first: Fp8Splits = ONE_DEVICE
    second: Fp8Splits = ONE_DEVICE


def plan(use: Fp8Use, tp_group=None) -> ExpertsFp8:
    """``use`` with the splits of experts whose FFN width is split over ``tp_group`` (expert
    TP; None: whole experts)."""
    if tp_group is None:
        return ExpertsFp8(use)
    return ExpertsFp8(use, column_splits(tp_group), row_splits(tp_group))


def _one(x, a1, c1, a2, c2, gated: bool, activation: str, f: ExpertsFp8) -> torch.Tensor:
    """One expert on its rows ``x [n, H]``: ``a1 [H, F]`` and ``a2 [F, H]`` are stored for
    ``x @ a``, so the Function's ``[out, in]`` weights are their transposed views."""
    h = fp8_linear(x, a1.t(), f.use, f.first, c1)
    return fp8_linear(hidden(h, gated, activation), a2.t(), f.use, f.second, c2)


def per_expert(parts, w1, b1, w2, b2, gated: bool, activation: str, f: ExpertsFp8) -> list:
    """Expert e on ``parts[e]`` ``[n_e, H]`` -> ``[n_e, H]`` each (the weights split by
    ``unbind``: one stacked gradient each). An empty block skips fp8 (no scale, no amax
    reduction: every expert-TP rank holds the same tokens, so all skip it) but stays in the
    autograd graph through empty matmuls: a rank whose experts all got no tokens still runs the
    EP dispatch's backward all-to-all, and its expert weights get (zero) gradients."""
    n = len(parts)
    weights = ([None] * n if t is None else t.unbind(0) for t in (w1, b1, w2, b2))
    outs = []
    for part, a1, c1, a2, c2 in zip(parts, *weights, strict=True):
        if part.shape[0] == 0:  # no GEMM, yet in the graph: the weights get zero gradients,
            h = hidden(part @ a1, gated, activation)  # and the dispatch's backward runs
            outs.append(h @ a2)
        else:
            outs.append(_one(part, a1, c1, a2, c2, gated, activation, f))
    return outs


def batched(x, w1, b1, w2, b2, gated: bool, activation: str, f: ExpertsFp8) -> torch.Tensor:
    """``fastpar.moe.experts.batched`` in fp8: x [E, C, H] -> [E, C, H] (a capacity block's
    padding rows are zeros: they change no amax)."""
    return torch.stack(per_expert(list(x.unbind(0)), w1, b1, w2, b2, gated, activation, f))


def segments(x, counts, w1, b1, w2, b2, gated: bool, activation: str, f: ExpertsFp8):
    """``fastpar.moe.experts.segments`` in fp8: x [N, H] grouped by ``counts`` -> [N, H]. The
    counts are read on the host (a graph break under ``torch.compile``)."""
    sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    outs = per_expert(list(x.split(sizes)), w1, b1, w2, b2, gated, activation, f)
    return torch.cat(outs) if outs else x
