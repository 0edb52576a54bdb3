"""The fp8 linear layer's autograd Function (issue 47): ``y = x @ W.T`` with both operands
quantized per an ``Fp8Recipe`` and both backward GEMMs in fp8 too; the high-precision weight
(fp32, or bf16 over fp32 masters) stays the autograd leaf and the fp8 copies live for one step.
Its one-device oracle is ``fastpar.reference.fp8_linear.linear_reference``. docs/kernels.md,
"fp8 linear layers".

A tensor-parallel layer passes how each operand is split on this rank, so that every scale is
one device's (``fastpar.ops.fp8.quantize``'s ``group`` / ``split_dim``)::

    column-parallel  x whole        weight [N/tp, K] split 0   grad [M, N/tp] split 1
    row-parallel     x [M, K/tp] 1  weight [N, K/tp] split 1   grad whole

(a sequence-parallel column layer quantizes its input after the all-gather: whole.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from fastpar.ops import fp8
from fastpar.reference import fp8 as ref_fp8
from fastpar.reference.fp8_linear import pad_rows


class Split(NamedTuple):
    """How an operand is split on this rank: over ``group``, along ``dim`` (0 or 1 of its 2-D
    form). ``WHOLE``: not split."""

    group: object = None
    dim: int | None = None


WHOLE = Split()


class Fp8Splits(NamedTuple):
    """The splits of a linear layer's three operands on this rank."""

    x: Split = WHOLE
    weight: Split = WHOLE
    grad: Split = WHOLE


ONE_DEVICE = Fp8Splits()
"""Nothing split: one device's layer."""


def column_splits(group) -> Fp8Splits:
    """A column-parallel layer's: the weight's output rows and the gradient's columns split."""
    return Fp8Splits(WHOLE, Split(group, 0), Split(group, 1))


def row_splits(group) -> Fp8Splits:
    """A row-parallel layer's: the input's and the weight's reduction columns split."""
    return Fp8Splits(Split(group, 1), Split(group, 1), WHOLE)


class Fp8Use(NamedTuple):
    """A layer's fp8: its recipe, and whether ``torch._scaled_mm`` may run the pairs it takes
    (``native=False``: the exact emulation always, for a device without fp8 GEMMs)."""

    recipe: fp8.Fp8Recipe
    native: bool = True


def _q(t: torch.Tensor, recipe, role: str, transpose: bool, split: Split) -> fp8.Quantized:
    return fp8.quantize(t, recipe, role, transpose, group=split.group, split_dim=split.dim)


class Fp8LinearFunction(torch.autograd.Function):
    """``y [M, N] = x [M, K] @ weight [N, K].T`` in fp8; y and dx in x's dtype, dw in the
    weight's. Forward: x as "activation", the weight as "weight"; backward: the output gradient
    as "grad", ``dx = scaled_mm(g, w.t())``, ``dw = scaled_mm(g.t(), x.t())`` (``.t()``: the
    transposed copies, quantized along the tokens for row and 1x128 groups). The tokens are
    zero-padded to the activation's multiple (exact). Saved for backward: the fp8 transposed
    copies only. Collectives: the amax max-reductions ``Fp8Splits`` ask for, nothing else."""

    @staticmethod
    def forward(ctx, x, weight, recipe, splits: Fp8Splits, native: bool = True):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        m = x.shape[0]
        xp = pad_rows(x, ref_fp8.MULTIPLE[recipe.granularity("activation")])
        xq = _q(xp, recipe, "activation", need_dw, splits.x)
        wq = _q(weight, recipe, "weight", need_dx, splits.weight)
        y = fp8.scaled_mm(xq, wq, x.dtype, native=native)
        ctx.recipe, ctx.splits, ctx.m, ctx.native = recipe, splits, m, native
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.grans = (xq.granularity, wq.granularity)
        ctx.save_for_backward(
            xq.data_t if need_dw else None,
            xq.scale_t if need_dw else None,
            wq.data_t if need_dx else None,
            wq.scale_t if need_dx else None,
        )
        return y[:m] if y.shape[0] != m else y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x8t, sxt, w8t, swt = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        recipe, splits, m = ctx.recipe, ctx.splits, ctx.m
        gp = pad_rows(grad_y, ref_fp8.MULTIPLE[recipe.granularity("activation")])
        gq = _q(gp, recipe, "grad", need_dw, splits.grad)
        dx = dw = None
        if need_dx:
            wt = fp8.Quantized(w8t, swt, None, None, ctx.grans[1])
            dx = fp8.scaled_mm(gq, wt, ctx.dtypes[0], native=ctx.native)[:m]
        if need_dw:
            xt = fp8.Quantized(x8t, sxt, None, None, ctx.grans[0])
            dw = fp8.scaled_mm(gq.t(), xt, ctx.dtypes[1], native=ctx.native)
        return dx, dw, None, None, None


def _apply(*args):
    return Fp8LinearFunction.apply(*args)


#: under torch.compile, blockwise runs eagerly (a graph break): inductor fails an assertion on
#: its block scales' reshapes (torch 2.13, CPU); tensorwise and rowwise compile. (torch's lazy
#: form: torch.compiler.disable imports dynamo, and with it Triton, at ``import fastpar``)
_eager_apply = torch._disable_dynamo(_apply)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    recipe: Fp8Use | fp8.Fp8Recipe | str,
    splits: Fp8Splits = ONE_DEVICE,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the GEMMs in fp8: x ``[..., K]``, weight ``[N, K]``
    (fp32 / bf16 / fp16), bias added in x's dtype after the GEMM. ``recipe``: an ``Fp8Use``,
    or a recipe (``torch._scaled_mm`` where it runs). ``splits``: how x, the weight and the
    output gradient are split on this rank (``column_splits``, ``row_splits``)."""
    use = recipe if isinstance(recipe, Fp8Use) else Fp8Use(fp8.recipe_of(recipe))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    blockwise = use.recipe.name == "blockwise"
    apply = _eager_apply if blockwise and torch.compiler.is_compiling() else _apply
    y = apply(x2, weight, use.recipe, splits, use.native)
    y = y.reshape(*lead, y.shape[-1])
    return y if bias is None else y + bias
