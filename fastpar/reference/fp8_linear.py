"""Pure-torch reference of a whole fp8 linear layer on one device: the forward GEMM and both
backward GEMMs (``fastpar.ops.fp8_linear``'s oracle). docs/kernels.md, "fp8 linear layers".

``recipe`` is anything with ``granularity(role)``, ``dtype(role)`` and ``pow2``
(``fastpar.ops.fp8.Fp8Recipe``; duck-typed, as this leaf imports torch alone). The tokens M are
zero-padded to the activation's multiple (16, or 128 for blockwise): a zero row changes no
max and adds nothing to any sum, so the padding is exact.
"""

from __future__ import annotations

import torch

from fastpar.reference import fp8 as ref


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x [M, C]`` with zero rows appended up to a multiple of ``multiple`` (x itself if none)."""
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, x.shape[1])])


def _operand(x: torch.Tensor, recipe, role: str):
    """(x8, scale, x8_t, scale_t, granularity) of ``x`` quantized for ``role``, with the
    transposed copy."""
    gran = recipe.granularity(role)
    return (*ref.quantize(x, recipe.dtype(role), gran, recipe.pow2, transpose=True), gran)


def _mm(a8, scale_a, b8, scale_b, gran_b: str, out_dtype, exact: bool) -> torch.Tensor:
    """``a @ b.T`` of ``a8 [M, K]`` and ``b8 [N, K]`` (``gran_b``: b's scaling groups);
    ``exact``: dequantized to and multiplied in float64."""
    if not exact:
        sb = scale_b if scale_b.dim() == 0 else scale_b.t()
        return ref.scaled_mm_reference(a8, b8.t(), scale_a, sb, out_dtype)
    ga = "row" if scale_a.dim() < 2 or scale_a.shape[1] == 1 else "1x128"
    a = ref.dequantize(a8, scale_a, ga).double()
    b = ref.dequantize(b8, scale_b, "row" if gran_b in ("tensor", "row") else gran_b).double()
    return a @ b.t()


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    grad_out: torch.Tensor | None,
    recipe,
    *,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, dx, dw) of the fp8 linear ``y = x @ weight.T`` on one device.

    x ``[M, K]``, weight ``[N, K]``, grad_out ``[M, N]`` (None: the forward alone). x is
    quantized as the recipe's "activation", the weight as its "weight", grad_out as its
    "grad"; y = scaled_mm(x, w) in x's dtype, dx = scaled_mm(g, w.t()) in x's dtype,
    dw = scaled_mm(g.t(), x.t()) in the weight's dtype (``.t()``: the transposed copy, quantized
    along the tokens for row and 1x128 groups). ``exact``: the same fp8 operands, dequantized
    and multiplied in float64 (the tolerance rule's exact run; results in float64).
    """
    m = x.shape[0]
    multiple = ref.MULTIPLE[recipe.granularity("activation")]
    x8, sx, x8t, sxt, gx = _operand(pad_rows(x, multiple), recipe, "activation")
    w8, sw, w8t, swt, gw = _operand(weight, recipe, "weight")
    y = _mm(x8, sx, w8, sw, gw, x.dtype, exact)[:m]
    if grad_out is None:
        return y, None, None
    g8, sg, g8t, sgt, _ = _operand(pad_rows(grad_out, multiple), recipe, "grad")
    dx = _mm(g8, sg, w8t, swt, gw, x.dtype, exact)[:m]
    dw = _mm(g8t, sgt, x8t, sxt, gx, weight.dtype, exact)
    return y, dx, dw
