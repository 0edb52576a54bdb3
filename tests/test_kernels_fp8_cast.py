"""Triton kernels of fp8 scaling (``fastpar.kernels.fp8_cast``) against the reference.

Interpreter tier (``TRITON_INTERPRET=1``, CPU tensors, Triton forced with
``backend.use_backend("triton")``): every recipe and block shape, fp32 / bf16 / fp16 inputs, sizes
spanning several 128 x 128 programs and odd sizes the recipe still takes (masked tiles):
amax and scales bit for bit, the clamped scaled values before the cast (``out_dtype=fp32``)
bit for bit for the tensor and its transposed copy, and the fp8 bytes bit for bit wherever the
interpreter's own fp32 -> fp8 conversion is right. That conversion is not (docs/kernels.md,
"fp8 scaling"): it rounds ties away from zero, loses the carry when rounding up to a power of
two lands on an odd exponent, and truncates subnormal results; ``_interpreter_exact`` marks the
elements where none of the three can happen (82 % of the elements drawn here). Determinism: two runs give the same bytes.
CPU tier: both kernels compile for sm_90 with 128-bit loads and stores and the cast is
``cvt.rn.satfinite`` (round to nearest even, saturating).
GPU tier (``-m cuda``): the fp8 bytes bit for bit everywhere (the conversion the interpreter
gets wrong), and an operand of more than 2^31 elements (int64 offsets).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from fastpar.ops import backend
from fastpar.ops import fp8 as op
from fastpar.reference import fp8 as ref

interpreter = pytest.mark.interpreter
cuda = pytest.mark.cuda
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MANTISSA = {E4: 3, E5: 2}
SMALLEST_NORMAL = {E4: 2.0**-6, E5: 2.0**-14}
# (recipe, shape): several programs each way, and odd sizes with masked tiles
CASES = [
    ("tensorwise", (272, 400)),
    ("tensorwise", (16, 16)),
    ("rowwise", (400, 272)),
    ("rowwise", (48, 160)),
    ("blockwise", (256, 384)),
    ("blockwise", (128, 128)),
]


def _kernels():
    from fastpar.kernels import fp8_cast as kernels  # defines kernels: import lazily

    return kernels


def _x(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)
    x[0, : shape[1] // 2] = 0.0  # zeros, and for blockwise an all-zero block
    return x.to(dtype)


def _interpreter_exact(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where Triton 3.9's interpreter casts fp32 ``y`` to fp8 right: a normal result, no tie
    (the bits below the kept mantissa exactly one half), no carry out of the mantissa."""
    m = MANTISSA[dtype]
    shift = 23 - m
    bits = y.view(torch.int32).to(torch.int64) & 0x7FFFFF
    guard = (bits >> (shift - 1)) & 1
    rest = bits & ((1 << (shift - 1)) - 1)
    kept = bits >> shift
    tie = (guard == 1) & (rest == 0)
    carry = (kept == (1 << m) - 1) & (guard == 1)
    return ~tie & ~carry & (y.abs() >= SMALLEST_NORMAL[dtype])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_cast(got, want, pre, dtype, where=""):
    """fp8 bytes equal wherever the interpreter converts right, and those are most elements."""
    ok = _interpreter_exact(pre, dtype)
    assert float(ok.float().mean()) > 0.5, f"{where}: too few elements checked"
    same = _bytes(got) == _bytes(want)
    assert bool(same[ok].all()), f"{where}: {int((~same & ok).sum())} fp8 values differ"


@interpreter
@pytest.mark.parametrize("recipe,shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interp_quantize_matches_reference(recipe, shape, dtype):
    k = _kernels()
    x = _x(shape, seed=sum(shape), dtype=dtype)
    roles = {"tensorwise": ("grad", "weight"), "rowwise": ("weight",)}.get(recipe, op.ROLES)
    for role in roles:  # tensorwise: e5m2 grads, e4m3 weights; blockwise: both block shapes
        want = op.quantize(x, recipe, role, transpose=True)  # CPU tensors: the reference
        with backend.use_backend("triton"):
            got = op.quantize(x, recipe, role, transpose=True)
        where = f"{recipe} {role} {tuple(shape)} {dtype}"
        fp8 = want.data.dtype
        assert got.granularity == want.granularity and got.data.dtype == fp8
        assert torch.equal(got.scale, want.scale) and torch.equal(got.scale_t, want.scale_t), where
        pre, pre_t = k.cast(
            x,
            want.scale,
            fp8,
            want.granularity,
            transpose=True,
            scale_t=want.scale_t,
            out_dtype=torch.float32,
        )
        full = ref.expand_scale(want.scale, tuple(shape), want.granularity)
        full_t = ref.expand_scale(want.scale_t, tuple(shape[::-1]), want.granularity)
        assert torch.equal(pre, ref.scaled(x, full, fp8)), where
        assert torch.equal(pre_t, ref.scaled(x.t(), full_t, fp8)), where
        _assert_cast(got.data, want.data, pre, fp8, where)
        _assert_cast(got.data_t, want.data_t, pre_t, fp8, where + " transposed")
        if want.granularity in ("tensor", "128x128"):  # the copy is the transpose
            assert torch.equal(_bytes(got.data_t), _bytes(got.data.t())), where


@interpreter
@pytest.mark.parametrize("gran", ref.GRANULARITIES)
def test_interp_amax_nan_saturation_and_determinism(gran):
    k = _kernels()
    x = _x((256, 256), seed=7, dtype=torch.float32)
    x[5, 9] = 1e30  # saturates: its group's other values land near 0
    a1, t1 = k.amax(x, gran, transpose=True)
    assert torch.equal(a1, ref.amax(x, gran))
    if t1 is not None:
        assert torch.equal(t1, ref.amax(x.t(), gran))
    scale = ref.scale_from_amax(a1, E5) * 2  # twice too large: values above the max
    big = ref.expand_scale(scale, (256, 256), gran)
    y1, _ = k.cast(x, scale, E5, gran, out_dtype=torch.float32)
    assert float(y1.abs().max()) == 57344.0  # the clamp, not inf
    assert torch.equal(y1, ref.scaled(x, big, E5))
    a2, t2 = k.amax(x, gran, transpose=True)
    y2, _ = k.cast(x, scale, E5, gran, out_dtype=torch.float32)
    assert torch.equal(a1, a2) and (t1 is None or torch.equal(t1, t2)) and torch.equal(y1, y2)
    x[200, 130] = float("nan")
    an, _ = k.amax(x, gran)
    assert torch.equal(torch.isnan(an), torch.isnan(ref.amax(x, gran)))


@interpreter
def test_interp_strided_rows_and_refusals():
    k = _kernels()
    base = _x((64, 96), seed=8, dtype=torch.bfloat16)
    x = base[:, :64]  # row stride 96: the kernels take it as it is
    with backend.use_backend("triton"):
        got = op.quantize(x, "rowwise", "activation", transpose=True)
    want = op.quantize(x.contiguous(), "rowwise", "activation", transpose=True)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.scale_t, want.scale_t)
    with pytest.raises(ValueError, match=re.escape("(96, 64)")):
        k.amax(base.t(), "row")  # column stride 96: refused (the op makes it contiguous)
    with pytest.raises(ValueError, match="scale_t"):
        k.cast(x, want.scale, E4, "row", transpose=True)


# --- CPU tier: the kernels compile for a GPU (no GPU needed) ----------------------------------


def _compile(fn, sig, consts, aligned):
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this Triton has no ahead-of-time compile API: {exc}")
    full = sig | {c: "constexpr" for c in consts}
    source = ASTSource(
        fn,
        full,
        constexprs={(list(full).index(c),): v for c, v in consts.items()},
        attrs={(list(full).index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(source, target=target, options={"num_warps": _kernels().NUM_WARPS})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the real JIT")
def test_compiles_for_sm90_with_wide_accesses_and_a_saturating_cast():
    import triton.language as tl

    k = _kernels()
    ints = {"R": "i32", "C": "i32", "stride_r": "i32"}
    sig = {"x_ptr": "*bf16", "tile_ptr": "*fp32", "row_ptr": "*fp32", "col_ptr": "*fp32"} | ints
    consts = dict(TILES=False, ROWS=True, COLS=True, BR=k.TILE, BC=k.TILE)
    ptx = _compile(k._amax_kernel, sig, consts, ["x_ptr", *ints]).asm["ptx"]
    assert "ld.global.v4.b32" in ptx, "amax: no 128-bit loads"
    for gran, fp8, tl_fp8, cvt in (
        (1, "*fp8e4nv", tl.float8e4nv, "e4m3"),
        (2, "*fp8e5", tl.float8e5, "e5m2"),
    ):
        sig = {"x_ptr": "*bf16", "scale_ptr": "*fp32", "scale_t_ptr": "*fp32"}
        sig |= {"out_ptr": fp8, "out_t_ptr": fp8} | ints
        consts = dict(MAXV=448.0, OUT_DTYPE=tl_fp8, GRAN=gran, TRANSPOSE=True)
        consts |= dict(BR=k.TILE, BC=k.TILE)
        aligned = ["x_ptr", "out_ptr", "out_t_ptr", *ints]
        ptx = _compile(k._cast_kernel, sig, consts, aligned).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, f"cast {cvt}: no 128-bit loads"
        stores = re.findall(r"st\.global[.\w]*", ptx)
        assert stores and set(stores) == {"st.global.v4.b32"}, f"cast {cvt}: stores {stores}"
        assert f"cvt.rn.satfinite.{cvt}x2.f32" in ptx, f"cast {cvt}: not a saturating RTNE cvt"


# --- GPU tier ------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("recipe,shape", [*CASES, ("rowwise", (4096, 8192))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_quantize_is_the_reference_bit_for_bit(recipe, shape, dtype):
    x = _x(shape, seed=11, dtype=dtype)
    for role in op.ROLES:
        want = op.quantize(x, recipe, role, transpose=True)
        got = op.quantize(x.cuda(), recipe, role, transpose=True)
        assert torch.equal(got.scale.cpu(), want.scale)
        assert torch.equal(got.scale_t.cpu(), want.scale_t)
        assert torch.equal(_bytes(got.data.cpu()), _bytes(want.data))
        assert torch.equal(_bytes(got.data_t.cpu()), _bytes(want.data_t))


@cuda
def test_cuda_more_than_2_31_elements():
    x = torch.ones(2**16 + 16, 2**15, dtype=torch.bfloat16, device="cuda")  # 2^31 + 2^19
    x[-1, -1] = 4.0
    got = op.quantize(x, "tensorwise", "weight")
    assert float(got.scale) == 112.0 and float(got.data[-1, -1].float()) == 448.0
    assert float(got.data[2**16 + 8, 5].float()) == 112.0


@cuda
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_scaled_mm_runs_natively_within_the_bound_of_the_emulation(recipe):
    x, w = _x((256, 512), seed=12, dtype=torch.bfloat16), _x((384, 512), 13, torch.bfloat16)
    a = op.quantize(x.cuda(), recipe, "activation")
    b = op.quantize(w.cuda(), recipe, "weight")
    assert op.runs_natively(a, b, torch.bfloat16)
    got = op.scaled_mm(a, b, torch.bfloat16).double()
    a64 = ref.dequantize(a.data, a.scale, a.granularity).double()
    b64 = ref.dequantize(b.data, b.scale, b.granularity).double().t()
    exact = a64 @ b64
    # fp32 accumulation (K + 8 roundings) plus 2^-12: Hopper's fp8 tensor cores keep about 14
    # bits in their partial sums before cuBLAS promotes them (DeepSeek-V3 report, section 3.3);
    # then the rounding to bf16
    bound = ((512 + 8) * 2.0**-24 + 2.0**-12) * (a64.abs() @ b64.abs()) + 2.0**-8 * exact.abs()
    assert bool(((got - exact).abs() <= bound * 1.01).all())
