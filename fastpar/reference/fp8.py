"""Pure-torch reference of fp8 scaling: amax per recipe granularity, scales, the saturating cast
and the scaled GEMM's exact emulation; the CPU path of ``fastpar.ops.fp8`` and the oracle of
``fastpar.kernels.fp8_cast``. Recipes and what was verified where:
docs/kernels.md ("fp8 scaling").

Layout: a quantized operand is 2-D ``[R, C]`` with the GEMM's reduction dim last (C): the
left operand ``a [M, K]`` as stored, the right one as ``w [N, K]`` (an ``nn.Linear`` weight)
used as ``b = w8.t()`` (``[K, N]``, column-major, as ``torch._scaled_mm`` wants it).
"""

from __future__ import annotations

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The fp8 formats by name: e4m3 (OCP "fn": no inf, max 448) and e5m2 (IEEE-like, max 57344)."""
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
EPS = 1e-12
"""The least amax a scale is computed from (an all-zero tensor gets scale fp8_max / EPS)."""
BLOCK = 128
"""DeepSeek-V3's block: activations and gradients 1 x 128 along C, weights 128 x 128."""
GRANULARITIES = ("tensor", "row", "1x128", "128x128")
"""How a quantized operand is grouped (``expand_scale`` also takes "128x1": a 1x128 operand
as the GEMM's ``b``)."""
MULTIPLE = {"tensor": 16, "row": 16, "1x128": BLOCK, "128x128": BLOCK}
"""What every dim of an operand must be a multiple of: torch._scaled_mm's 16, the block's 128."""


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of the fp8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in FP8_MAX:
        raise ValueError(f"{dtype} is not an fp8 format; use one of {list(FP8_MAX)}")
    return FP8_MAX[dtype]


def check_shape(shape: tuple[int, ...] | torch.Size, granularity: str, what: str = "x") -> None:
    """Raise one ValueError line naming the shape and the fix unless ``shape`` is 2-D with every
    dim a multiple of ``MULTIPLE[granularity]``."""
    if granularity not in MULTIPLE:
        raise ValueError(f"granularity {granularity!r} is not one of {GRANULARITIES}")
    m = MULTIPLE[granularity]
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(
            f"{what} has shape {shape}: fp8 scaling takes 2-D operands [rows, reduction dim]; "
            f"reshape it (x.reshape(-1, x.shape[-1]))"
        )
    if shape[0] % m or shape[1] % m:
        raise ValueError(
            f"{what} has shape {shape}: {granularity} scaling needs every dim a multiple of {m}"
            f"{' (torch._scaled_mm)' if m == 16 else ' (the block)'}; pad it to "
            f"{tuple(-(-d // m) * m for d in shape)} or use another recipe"
        )


def amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max |x| over each scaling group of ``x [R, C]``, in x's dtype (exact: a max is one of x's
    values). Shapes: tensor ``[]``; row ``[R, 1]``; 1x128 ``[R, C/128]``; 128x128
    ``[R/128, C/128]``. NaN in a group gives NaN."""
    check_shape(x.shape, granularity)
    a = x.abs()
    r, c = x.shape
    if granularity == "tensor":
        return a.amax()
    if granularity == "row":
        return a.amax(dim=1, keepdim=True)
    if granularity == "1x128":
        return a.reshape(r, c // BLOCK, BLOCK).amax(dim=2)
    return a.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK).amax(dim=(1, 3))


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """fp32 scales ``fp8_max / max(amax, EPS)``, the division in float64 then rounded once to
    fp32 (torchao's order); ``pow2`` rounds each scale DOWN to a power of two (exact: the
    fp32 mantissa is dropped), so that dequantizing (``1 / scale``) is exact too. amax: any
    float dtype, any shape; the scales have its shape."""
    scale = (fp8_max(dtype) / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    if pow2:  # keep the exponent bits: exact on every device (scales are positive and normal)
        floor = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
        scale = torch.where(torch.isnan(scale), scale, floor)
    return scale


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], granularity: str) -> torch.Tensor:
    """The scale of every element of an ``[R, C]`` operand (a view or an expanded copy)."""
    r, c = shape
    if granularity in ("tensor", "row"):
        return scale.expand(r, c)
    if granularity == "1x128":
        return scale.repeat_interleave(BLOCK, dim=1)
    if granularity == "128x1":  # a 1x128-scaled operand seen transposed (the GEMM's b)
        return scale.repeat_interleave(BLOCK, dim=0)
    return scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)


def scaled(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``clamp(fp32(x) · scale, -max, max)`` in fp32, the value the cast rounds; ``scale``
    broadcasts against x (expand it first for blocks). The clamp matters: torch's cast to e5m2
    does not saturate (it gives ±inf above 57344)."""
    m = fp8_max(dtype)
    return torch.clamp(x.float() * scale, -m, m)


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, granularity: str):
    """x ``[R, C]`` scaled by ``scale`` (granularity's shape), saturated, rounded to ``dtype``."""
    return scaled(x, expand_scale(scale, tuple(x.shape), granularity), dtype).to(dtype)


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    pow2: bool = False,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(x8 ``[R, C]``, scale, x8_t ``[C, R]`` or None, scale_t or None) of ``x [R, C]``.

    ``x8 = cast(x, scale)`` with ``scale = scale_from_amax(amax(x))``. The transposed copy is
    what the weight-gradient GEMM reads (its reduction dim is R): ``quantize(x.t())`` with the
    same granularity, contiguous. For tensor and 128x128 scales it holds the same values as
    ``x8.t()`` (scale_t is scale, resp. scale.t()); for row and 1x128 scales the groups run
    along R, so its scales are x's column maxima (resp. 128 x 1 blocks).
    """
    check_shape(x.shape, granularity)
    scale = scale_from_amax(amax(x, granularity), dtype, pow2)
    x8 = cast(x, scale, dtype, granularity)
    if not transpose:
        return x8, scale, None, None
    if granularity == "tensor":
        return x8, scale, x8.t().contiguous(), scale
    if granularity == "128x128":
        return x8, scale, x8.t().contiguous(), scale.t().contiguous()
    xt = x.t()
    scale_t = scale_from_amax(amax(xt, granularity), dtype, pow2)
    return x8, scale, cast(xt, scale_t, dtype, granularity).contiguous(), scale_t


def dequantize(x8: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """fp32 ``x8 · (1 / scale)`` (the reciprocal in fp32, as torch._scaled_mm is handed it)."""
    return x8.float() * expand_scale(scale.reciprocal(), tuple(x8.shape), granularity)


def scaled_mm_reference(
    a8: torch.Tensor,
    b8: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The scaled GEMM, emulated: ``((a8 · 1/scale_a) @ (b8 · 1/scale_b)).to(out_dtype)`` in fp32.

    a8 ``[M, K]``, b8 ``[K, N]`` fp8 (any layout); scales are the quantize scales (not their
    reciprocals): tensorwise 0-dim and 0-dim, rowwise ``[M, 1]`` and ``[1, N]``, blockwise
    ``[M, K/128]`` (1x128) and ``[K/128, N/128]`` (128x128) or ``[K/128, N]`` (b 1x128 along K:
    the weight-gradient GEMM, both operands transposed copies). Bit for bit torch._scaled_mm's
    CPU result for tensorwise and rowwise with oneDNN off (docs/kernels.md).
    """
    if a8.dim() != 2 or b8.dim() != 2 or a8.shape[1] != b8.shape[0]:
        raise ValueError(
            f"scaled_mm: a {tuple(a8.shape)} @ b {tuple(b8.shape)} must be [M, K] @ [K, N]"
        )
    m, k = a8.shape
    n = b8.shape[1]
    ga = gb = "row"  # tensorwise and rowwise scales broadcast alike
    if scale_b.dim() == 2 and tuple(scale_b.shape) != (1, n):  # blockwise
        ga = "1x128"
        gb = "128x1" if tuple(scale_b.shape) == (k // BLOCK, n) else "128x128"
        check_shape(a8.shape, ga, "a")
        check_shape(b8.shape, ga, "b")
        nb = n if gb == "128x1" else n // BLOCK
        want = ((m, k // BLOCK), (k // BLOCK, nb))
        if (tuple(scale_a.shape), tuple(scale_b.shape)) != want:
            raise ValueError(
                f"scaled_mm: blockwise scales have shapes {tuple(scale_a.shape)} and "
                f"{tuple(scale_b.shape)}; a {(m, k)} @ b {(k, n)} needs {want[0]} and {want[1]}"
            )
    a = dequantize(a8, scale_a, ga)
    b = dequantize(b8, scale_b, gb)
    return (a @ b).to(out_dtype)
