"""The fp8 reference (``fastpar.reference.fp8``) and the op layer on CPU (``fastpar.ops.fp8``).

Against float64 math: the scales (Python double division rounded once to fp32; powers of two
by ``math.frexp``), the cast (round to nearest even on the fp8 grid, computed here from the
bit patterns), the GEMM emulation (within the rigorous fp32 dot-product bound). Against
``torch._scaled_mm`` on CPU: bit for bit with oneDNN off, for tensorwise and rowwise, every
e4m3 / e5m2 pairing, out bf16 and fp32; within the same fp64 bound with oneDNN on. The facts
the op layer rests on (what torch._scaled_mm refuses on CPU, that the e5m2 cast does not
saturate) are pinned here too, so a torch upgrade that changes them fails a test.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch

from fastpar.ops import fp8 as op
from fastpar.reference import fp8 as ref

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
U32 = 2.0**-24


def _x(shape, seed, dtype=torch.float32, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * spread)
    return x.to(dtype)


def _rtne_codes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 bit patterns of fp32 ``y`` (already within ±max) rounded to nearest, ties to the
    even pattern, found on the grid of every positive finite value in float64."""
    top = 0x7E if dtype == E4 else 0x7B  # the largest finite positive pattern
    grid = torch.arange(top + 1, dtype=torch.uint8).view(dtype).double()
    mag = y.double().abs().reshape(-1)
    hi = torch.searchsorted(grid, mag).clamp(max=top)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = torch.where(d_hi < d_lo, hi, lo)
    pick = torch.where((d_hi == d_lo) & (hi % 2 == 0), hi, pick)
    sign = torch.signbit(y.reshape(-1)).to(torch.int64) << 7
    return (pick | sign).to(torch.uint8).reshape(y.shape)


def _scale64(amax: float, dtype: torch.dtype, pow2: bool) -> float:
    """torchao's scale in Python doubles, rounded once to fp32; a power of two below it."""
    s = float(np.float32(ref.FP8_MAX[dtype] / max(amax, 1e-12)))
    if pow2:
        s = math.ldexp(0.5, math.frexp(s)[1])
    return s


def _gemm_bound(a: torch.Tensor, b: torch.Tensor, k: int, out_dtype) -> torch.Tensor:
    """|fp32 GEMM of dequantized operands - exact| <= (K + 4)·u·(|A| @ |B|) (+ the final
    rounding to bf16); A, B the exact float64 dequantized operands."""
    bound = (k + 4) * U32 * (a.abs() @ b.abs()) * 1.01
    return bound if out_dtype == torch.float32 else bound + 2.0**-8 * (a @ b).abs() * 1.01


@pytest.mark.parametrize("gran", ref.GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("pow2", [False, True])
def test_scales_and_cast_against_float64(gran, dtype, pow2):
    x = _x((256, 384), seed=1)
    x[3, 5:200] = 0.0  # a row with a zero 1x128 block
    x[130:140] *= 1e-20  # tiny values: subnormal fp8 results
    x8, scale, *_ = ref.quantize(x, dtype, gran, pow2)
    groups = ref.amax(x, gran).double()
    want = torch.tensor([_scale64(float(a), dtype, pow2) for a in groups.reshape(-1)])
    assert torch.equal(scale.reshape(-1), want.float()), gran
    full = ref.expand_scale(scale, (256, 384), gran)
    y = (x.double() * full.double()).float()  # the fp32 product, exactly (24 + 24 bits < 53)
    y = y.clamp(-ref.FP8_MAX[dtype], ref.FP8_MAX[dtype])
    assert torch.equal(x8.view(torch.uint8), _rtne_codes(y, dtype))
    # a group's max |x| lands on ±max (below it for pow2 scales, or an amax under EPS)
    top = ref.amax(x8.float(), gran)
    assert bool((top <= ref.FP8_MAX[dtype]).all())
    if not pow2:
        assert bool(((top == ref.FP8_MAX[dtype]) | (groups < ref.EPS)).all())


def test_zero_and_tiny_amax_take_the_eps_clamp():
    x = torch.zeros(32, 16)
    x[1, 0] = 1e-13  # below EPS: the scale of a zero row, so it lands far below 448
    x[2, 3] = -1e-11  # above EPS: its own scale
    x8, scale, *_ = ref.quantize(x, E4, "row")
    eps_scale = float(np.float32(448.0 / 1e-12))
    assert float(scale[0, 0]) == float(scale[1, 0]) == eps_scale
    assert float(scale[2, 0]) == float(np.float32(448.0 / 1e-11))
    assert float(x8[2, 3].float()) == -448.0 and int((x8.float() != 0).sum()) == 2
    assert float(x8[1, 0].float()) == float(torch.tensor(1e-13 * eps_scale).to(E4).float()) == 44.0
    s = ref.quantize(torch.zeros(16, 16), E5, "tensor", pow2=True)[1]
    assert float(s) == 2.0 ** math.floor(math.log2(57344.0 / 1e-12)) and s.dim() == 0


@pytest.mark.parametrize("dtype", [E4, E5])
def test_saturation_at_the_format_max(dtype):
    m = ref.FP8_MAX[dtype]
    x = torch.tensor([[m * 4, -m * 4, m, -m, m * 1.03, float("inf")] + [1.0] * 10])
    got = ref.cast(x, torch.tensor(1.0), dtype, "tensor").float()
    assert got[0, :6].tolist() == [m, -m, m, -m, m, m]
    if dtype == E5:  # why the clamp: torch's e5m2 cast does not saturate
        assert math.isinf(float(torch.tensor(m * 1.1).to(E5).float()))
    # an amax element maps to exactly ±max under its own (unrounded) scale
    x = _x((16, 32), seed=2)
    x8, *_ = ref.quantize(x, dtype, "row")
    assert torch.equal(x8.float().abs().amax(dim=1), torch.full((16,), m))


def test_pow2_scales_round_down_exactly():
    amax = torch.tensor([1e-12, 3e-5, 0.7, 1.0, 3.0, 448.0, 5e3, 2.0**20])
    for dtype in (E4, E5):
        plain = ref.scale_from_amax(amax, dtype)
        p2 = ref.scale_from_amax(amax, dtype, pow2=True)
        mant, _ = torch.frexp(p2)
        assert bool((mant == 0.5).all()) and bool((p2 <= plain).all() & (p2 > plain / 2).all())
        want = [_scale64(float(a), dtype, True) for a in amax.double()]
        assert p2.tolist() == want


@pytest.mark.parametrize("gran", ref.GRANULARITIES)
def test_transposed_copy_is_the_quantized_transpose(gran):
    x = _x((256, 128), seed=3, dtype=torch.bfloat16)
    x8, _, x8t, scale_t = ref.quantize(x, E4, gran, pow2=True, transpose=True)
    want = ref.quantize(x.t().contiguous(), E4, gran, pow2=True)
    assert x8t.is_contiguous() and x8t.shape == (128, 256)
    assert torch.equal(x8t.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scale_t, want[1])
    if gran in ("tensor", "128x128"):  # the same values, transposed
        assert torch.equal(x8t.view(torch.uint8), x8.t().view(torch.uint8))


def _pair(recipe, da, db, m=48, k=96, n=64, seed=4, dtype=torch.float32):
    a = op.quantize(_x((m, k), seed, dtype, spread=1.0), op.Fp8Recipe(recipe, da), "activation")
    b = op.quantize(_x((n, k), seed + 1, dtype, spread=1.0), op.Fp8Recipe(recipe, db), "weight")
    return a, b


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("da,db", list(itertools.product([E4, E5], [E4, E5])))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_emulation_is_torch_scaled_mm_bit_for_bit(recipe, da, db, out_dtype):
    a, b = _pair(recipe, da, db)
    assert op.runs_natively(a, b, out_dtype)
    emulated = op.scaled_mm(a, b, out_dtype, native=False)
    with torch.backends.mkldnn.flags(enabled=False):
        native = op.scaled_mm(a, b, out_dtype)
    assert native.dtype == emulated.dtype == out_dtype
    assert torch.equal(native, emulated)
    # float64 math: the dequantized operands exactly, then the rigorous bound
    a64 = a.data.double() / a.scale.double()
    b64 = (b.data.double() / b.scale.double()).t()
    exact = a64 @ b64
    bound = _gemm_bound(a64, b64, a64.shape[1], out_dtype)
    assert bool(((emulated.double() - exact).abs() <= bound).all())
    with torch.backends.mkldnn.flags(enabled=True):  # oneDNN (AMX where present): in bound too
        assert bool(((op.scaled_mm(a, b, out_dtype).double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_blockwise_emulation_equals_per_block_float64(out_dtype):
    m, k, n = 128, 384, 256
    a, b = _pair("blockwise", E4, E4, m, k, n, seed=5, dtype=torch.bfloat16)
    assert a.scale.shape == (m, k // 128) and b.scale.shape == (n // 128, k // 128)
    assert not op.runs_natively(a, b)
    got = op.scaled_mm(a, b, out_dtype)  # no native blockwise on CPU: the emulation
    exact = torch.zeros(m, n, dtype=torch.float64)
    a64s, b64s = [], []
    for kb in range(k // 128):
        cols = slice(kb * 128, (kb + 1) * 128)
        a_blk = a.data[:, cols].double() / a.scale[:, kb : kb + 1].double()
        b_blk = torch.cat(
            [
                b.data[nb * 128 : (nb + 1) * 128, cols].double() / b.scale[nb, kb].double()
                for nb in range(n // 128)
            ]
        )
        exact += a_blk @ b_blk.t()
        a64s.append(a_blk)
        b64s.append(b_blk.t())
    a64, b64 = torch.cat(a64s, dim=1), torch.cat(b64s, dim=0)
    assert bool(((got.double() - exact).abs() <= _gemm_bound(a64, b64, k, out_dtype)).all())
    # the dequantized operands are per-block products, bit for bit
    deq = ref.dequantize(a.data, a.scale, "1x128")
    assert torch.equal(deq[:, 128:256], a.data[:, 128:256].float() * a.scale[:, 1:2].reciprocal())


@pytest.mark.parametrize("recipe", op.RECIPES)
def test_the_three_gemms_of_a_linear_layer_against_float64(recipe):
    """y = x w^T, dx = g w, dw = g^T x from the quantized operands and their transposed copies
    (blockwise dw: 1x128 by 1x128 along the tokens), each within the fp32 bound of float64."""
    m, k, n = 256, 128, 384
    x = op.quantize(_x((m, k), 6, torch.bfloat16, 1.0), recipe, "activation", transpose=True)
    w = op.quantize(_x((n, k), 7, torch.bfloat16, 1.0), recipe, "weight", transpose=True)
    g = op.quantize(_x((m, n), 8, torch.bfloat16, 1.0), recipe, "grad", transpose=True)

    def deq(q):  # float64 operand [R, C] from its fp8 values and scales, block by block
        r, c = q.data.shape
        return q.data.double() / ref.expand_scale(q.scale.double(), (r, c), q.granularity)

    for a, b, shape in ((x, w, (m, n)), (g, w.t(), (m, k)), (g.t(), x.t(), (n, k))):
        got = op.scaled_mm(a, b, torch.float32)
        a64, b64 = deq(a), deq(b).t()
        assert got.shape == shape
        exact = a64 @ b64
        assert bool(
            (
                (got.double() - exact).abs() <= _gemm_bound(a64, b64, a64.shape[1], torch.float32)
            ).all()
        )
    # the copies and the originals dequantize to x within half an e4m3 step (2^-4 relative;
    # 2^-10 / scale in the subnormals)
    x64 = _x((m, k), 6, torch.bfloat16, 1.0).double()
    for q, want in ((x, x64), (x.t(), x64.t())):
        step = ref.expand_scale(q.scale.double(), tuple(want.shape), q.granularity)
        assert bool(((deq(q) - want).abs() <= 2**-4 * want.abs() + 2**-10 / step).all())
    with pytest.raises(ValueError, match="transpose=True"):
        op.quantize(
            torch.ones(16, 16), recipe if recipe != "blockwise" else "tensorwise", "weight"
        ).t()


def test_which_pairs_run_natively_off_the_cpu():
    """CUDA's rules (from torch's checks, not run here), seen through meta tensors."""

    def q(dtype, gran):
        data = torch.empty(32, 32, dtype=dtype, device="meta")
        return op.Quantized(data, torch.empty(()), None, None, gran)

    assert op.runs_natively(q(E4, "tensor"), q(E5, "tensor"), torch.float32)
    assert not op.runs_natively(q(E5, "tensor"), q(E5, "tensor"))  # cuBLASLt has no e5m2 x e5m2
    assert op.runs_natively(q(E4, "row"), q(E4, "row"), torch.bfloat16)
    assert not op.runs_natively(q(E4, "row"), q(E4, "row"), torch.float32)  # rowwise: bf16 only
    assert not op.runs_natively(q(E4, "1x128"), q(E4, "128x128"))


def test_what_torch_scaled_mm_runs_on_cpu():
    """The facts scaled_mm's choice rests on (torch 2.13 CPU); a change fails here."""
    a8 = torch.ones(128, 256).to(E4)
    b8 = torch.ones(128, 256).to(E4).t()
    one = torch.tensor(1.0)
    out = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    assert float(out[0, 0]) == 256.0
    ones = torch.ones
    for sa, sb in ((ones(128, 2), ones(2, 1)), (ones(128, 1), one)):  # blockwise, mixed
        with pytest.raises((RuntimeError, ValueError), match="Invalid scaling configuration"):
            torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be a matrix"):
        torch._scaled_mm(a8[None], b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    offs = torch.tensor([64, 128], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        torch._scaled_grouped_mm(
            a8,
            b8.t().reshape(2, 128, 128).transpose(-2, -1),
            ones(128),
            ones(2, 128),
            offs=offs,
            out_dtype=torch.bfloat16,
        )


@pytest.mark.parametrize(
    "shape,gran,words",
    [
        ((30, 64), "tensor", ["(30, 64)", "multiple of 16", "(32, 64)"]),
        ((64, 24), "row", ["(64, 24)", "multiple of 16", "(64, 32)"]),
        ((128, 200), "1x128", ["(128, 200)", "multiple of 128", "(128, 256)"]),
        ((100, 256), "128x128", ["(100, 256)", "multiple of 128", "(128, 256)"]),
        ((2, 16, 16), "tensor", ["(2, 16, 16)", "reshape"]),
    ],
)
def test_bad_shapes_are_refused_in_one_line(shape, gran, words):
    with pytest.raises(ValueError) as err:
        ref.quantize(torch.ones(shape), E4, gran)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_recipes_and_their_refusals():
    t, r, b = (op.Fp8Recipe(n) for n in op.RECIPES)
    assert (t.grad_dtype, r.grad_dtype, b.grad_dtype) == (E5, E4, E4)
    assert (t.pow2, r.pow2, b.pow2) == (False, True, True)
    assert [b.granularity(role) for role in op.ROLES] == ["1x128", "128x128", "1x128"]
    assert t.dtype("grad") == E5 and t.dtype("weight") == E4 and r.granularity("grad") == "row"
    assert op.recipe_of("rowwise") == r
    for bad, words in (
        (lambda: op.Fp8Recipe("colwise"), "'colwise'"),
        (lambda: op.Fp8Recipe("rowwise", torch.bfloat16), "forward_dtype=torch.bfloat16"),
        (lambda: op.Fp8Recipe("rowwise", grad_dtype=torch.float16), "grad_dtype=torch.float16"),
        (lambda: t.granularity("bias"), "'bias'"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            bad()
    with pytest.raises(TypeError, match=r"torch\.int64"):
        op.quantize(torch.ones(16, 16, dtype=torch.int64), "tensorwise", "weight")
    a, _ = _pair("tensorwise", E4, E4)
    _, w = _pair("rowwise", E4, E4)
    with pytest.raises(ValueError, match="one recipe"):
        op.scaled_mm(a, w)
    with pytest.raises(ValueError, match="weight second"):
        op.scaled_mm(w._replace(granularity="128x128"), a)
