"""fp8 scaling: the recipes (``Fp8Recipe``), ``quantize`` (amax, scale, saturating cast and the
transposed copy; Triton on CUDA, the reference elsewhere) and ``scaled_mm`` (torch._scaled_mm
where it runs, the exact emulation where it does not). No host sync. docs/kernels.md, "fp8 scaling".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fastpar.comm import group_size, plain
from fastpar.ops import backend
from fastpar.reference import fp8 as ref

OP = "fp8_quantize"
RECIPES = ("tensorwise", "rowwise", "blockwise")
ROLES = ("activation", "weight", "grad")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

backend.register_op(
    OP,
    ("triton", "reference"),
    "fp8 amax per tensor / row / block, scale, saturating cast and its transposed copy",
)


@dataclass(frozen=True)
class Fp8Recipe:
    """How one fp8 recipe scales the operands of a linear layer's three GEMMs."""

    name: str = "tensorwise"
    """tensorwise (one scale per tensor), rowwise (one per row along the reduction dim) or
    blockwise (DeepSeek-V3: activations and gradients 1 x 128, weights 128 x 128)."""
    forward_dtype: torch.dtype = torch.float8_e4m3fn
    """The activations' and weights' format."""
    grad_dtype: torch.dtype | None = None
    """The output gradients' format; None: e5m2 for tensorwise (range), e4m3 otherwise."""
    pow2: bool | None = None
    """Round scales down to powers of two; None: False for tensorwise, True otherwise."""

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"fp8 recipe {self.name!r} is not one of {'/'.join(RECIPES)}")
        for field in ("forward_dtype", "grad_dtype"):
            value = getattr(self, field)
            if value is not None and value not in ref.FP8_MAX:
                raise ValueError(
                    f"Fp8Recipe.{field}={value} is not an fp8 format; use "
                    f"torch.float8_e4m3fn or torch.float8_e5m2"
                )
        if self.grad_dtype is None:
            tensorwise = self.name == "tensorwise"
            grad = torch.float8_e5m2 if tensorwise else torch.float8_e4m3fn
            object.__setattr__(self, "grad_dtype", grad)
        if self.pow2 is None:
            object.__setattr__(self, "pow2", self.name != "tensorwise")

    def granularity(self, role: str) -> str:
        """The scaling group of an operand in ``role`` (activation, weight or grad)."""
        if role not in ROLES:
            raise ValueError(f"fp8 role {role!r} is not one of {'/'.join(ROLES)}")
        if self.name == "tensorwise":
            return "tensor"
        if self.name == "rowwise":
            return "row"
        return "128x128" if role == "weight" else "1x128"

    def dtype(self, role: str) -> torch.dtype:
        """The fp8 format of an operand in ``role``."""
        self.granularity(role)  # checks the role
        return self.grad_dtype if role == "grad" else self.forward_dtype  # type: ignore[return-value]


def recipe_of(recipe: Fp8Recipe | str) -> Fp8Recipe:
    """An Fp8Recipe from itself or its name (ValueError naming a bad one)."""
    return recipe if isinstance(recipe, Fp8Recipe) else Fp8Recipe(recipe)


class Quantized(NamedTuple):
    """An fp8 operand: data ``[R, C]``, its fp32 scales (the multiplier that quantized it; the
    granularity's shape), and the transposed copy ``[C, R]`` with its scales, or None."""

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor | None
    scale_t: torch.Tensor | None
    granularity: str

    def t(self) -> Quantized:
        """The transposed copy as an operand of its own (``[C, R]``, reduction dim R)."""
        if self.data_t is None:
            raise ValueError("this operand has no transposed copy: quantize(..., transpose=True)")
        return Quantized(self.data_t, self.scale_t, None, None, self.granularity)


def _kernels() -> Any:
    return importlib.import_module("fastpar.kernels.fp8_cast")


def quantize(
    x: torch.Tensor,
    recipe: Fp8Recipe | str,
    role: str,
    transpose: bool = False,
    *,
    group=None,
    split_dim: int | None = None,
) -> Quantized:
    """Quantize ``x [R, C]`` (fp32 / bf16 / fp16, reduction dim last) for ``role``.

    Scales per ``recipe.granularity(role)`` from max |x| (``fastpar.reference.fp8``), values
    ``clamp(fp32(x) · scale, ±max)`` rounded to ``recipe.dtype(role)``. With ``transpose`` also
    the ``[C, R]`` copy quantized along R, for the weight-gradient GEMM. CUDA tensors: two
    Triton launches (amax, then cast + copy) around the scales' torch ops; else the reference.
    A shape the recipe cannot take is one ValueError line naming it.

    ``group`` and ``split_dim``: ``x`` is this rank's even slice along ``split_dim`` of one
    tensor split over ``group``. Every scaling group the split cuts takes its amax over the
    group (``shared_amax``), so each rank quantizes its slice exactly as one device quantizes
    the whole tensor: the same scales and the same fp8 values, sliced.
    """
    recipe = recipe_of(recipe)
    gran, dtype = recipe.granularity(role), recipe.dtype(role)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize: x is {x.dtype}; expected float32, bfloat16 or float16")
    ref.check_shape(x.shape, gran)
    cut, cut_t = split_groups(gran, split_dim, group)
    triton = backend.select(OP, x.device.type) == "triton"
    if not triton and not (cut or cut_t):
        return Quantized(*ref.quantize(x, dtype, gran, recipe.pow2, transpose), gran)
    if triton:
        x = x if x.stride(1) == 1 else x.contiguous()
        amax, amax_t = _kernels().amax(x, gran, transpose)
    else:
        amax = ref.amax(x, gran)
        own_t = transpose and gran in ("row", "1x128")  # other groups than x's
        amax_t = ref.amax(x.t(), gran) if own_t else None
    amax = shared_amax(amax, group) if cut else amax
    amax_t = shared_amax(amax_t, group) if cut_t and amax_t is not None else amax_t
    scale = ref.scale_from_amax(amax, dtype, recipe.pow2)
    scale_t = None if amax_t is None else ref.scale_from_amax(amax_t, dtype, recipe.pow2)
    if triton:
        data, data_t = _kernels().cast(x, scale, dtype, gran, transpose=transpose, scale_t=scale_t)
    else:
        data = ref.cast(x, scale, dtype, gran)
        data_t = None
        if transpose:
            data_t = (
                data.t().contiguous()
                if scale_t is None
                else ref.cast(x.t(), scale_t, dtype, gran).contiguous()
            )
    if transpose and scale_t is None:
        scale_t = scale if gran == "tensor" else scale.t().contiguous()
    return Quantized(data, scale, data_t, scale_t, gran)


def split_groups(granularity: str, split_dim: int | None, group) -> tuple[bool, bool]:
    """(whether x's scaling groups, whether its transposed copy's, are cut by a split of x
    along ``split_dim`` over ``group``). One scale per tensor: always cut. Rows (groups along
    dim 1): x's when dim 1 is split, the copy's (along dim 0) when dim 0 is. Blocks of 128: never,
    as each rank's slice is a multiple of 128 along both dims (``check_shape``), so the split
    falls between blocks."""
    if group is None or group_size(group) == 1:
        return False, False
    if split_dim not in (0, 1):
        raise ValueError(f"quantize: split_dim must be 0 or 1 with a group, got {split_dim!r}")
    if granularity == "tensor":
        return True, True
    if granularity == "row":
        return split_dim == 1, split_dim == 0
    return False, False


def shared_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """``amax`` max-reduced over ``group`` (in fp32: exact for every float dtype's values)."""
    wide = amax.float().contiguous()
    plain.all_reduce(wide, op=plain.MAX, group=group)
    return wide.to(amax.dtype)


def runs_natively(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``scaled_mm`` hands this pair to ``torch._scaled_mm``.

    CPU (torch 2.13, verified by the tests): any tensorwise or rowwise pair, every e4m3 / e5m2
    pairing, out bf16 or fp32. CUDA (from torch's checks and issue threads, not yet run here):
    the same pairs but never e5m2 x e5m2 (cuBLASLt), and rowwise only into bf16. Blockwise
    always takes the emulation (torch's sm_90 blockwise GEMM wants other scale layouts: left
    for a GPU).
    """
    if a.granularity not in ("tensor", "row") or a.granularity != b.granularity:
        return False
    if a.data.device.type == "cpu":
        return True
    both_e5m2 = a.data.dtype == b.data.dtype == torch.float8_e5m2
    return not both_e5m2 and (a.granularity == "tensor" or out_dtype == torch.bfloat16)


def scaled_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16, *, native: bool = True
) -> torch.Tensor:
    """``a @ b.T`` of two quantized operands sharing the reduction dim K: ``a.data [M, K]``,
    ``b.data [N, K]`` (an ``nn.Linear`` weight); returns ``[M, N]`` in ``out_dtype``. A linear
    layer's three GEMMs: ``y = scaled_mm(x, w)``, ``dx = scaled_mm(g, w.t())``,
    ``dw = scaled_mm(g.t(), x.t())`` (blockwise: 1x128 by 128x128, and 1x128 by 1x128 for dw).

    Pairs ``runs_natively`` accepts run ``torch._scaled_mm`` (scales passed as reciprocals; on
    CPU it equals ``fastpar.reference.fp8.scaled_mm_reference`` bit for bit with oneDNN off,
    and stays within the fp32 error bound with it on). Blockwise pairs, which
    torch._scaled_mm refuses on CPU, the others and ``native=False`` take the exact emulation
    (fp32 GEMM of the dequantized operands: slow, for tests and CPU runs).
    """
    pair = (a.granularity, b.granularity)
    if a.granularity == "128x128":
        raise ValueError(
            f"scaled_mm: a is 128x128-scaled, b {b.granularity}-scaled; pass the activation "
            "(or gradient) first and the weight second"
        )
    if pair not in (("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128")):
        raise ValueError(
            f"scaled_mm: a is {a.granularity}-scaled and b {b.granularity}-scaled; quantize both "
            "with one recipe"
        )
    b8 = b.data.t()  # [K, N], column-major
    scale_b = b.scale if b.scale.dim() == 0 else b.scale.t()  # [1, N], [K/128, N/128], [K/128, N]
    if native and runs_natively(a, b, out_dtype):
        return torch._scaled_mm(
            a.data,
            b8,
            scale_a=a.scale.reciprocal(),
            scale_b=scale_b.reciprocal().contiguous(),
            out_dtype=out_dtype,
        )
    return ref.scaled_mm_reference(a.data, b8, a.scale, scale_b, out_dtype)
