"""Triton kernel of the fused unscale + inf/NaN check + grad-norm pass.

Interpreter tier (``TRITON_INTERPRET=1``, CPU tensors, Triton forced with
``backend.use_backend("triton")``): the op against the torch reference and against float64
math: 1 / 7 / 1,000 tensors, empty and size-1 tensors, a tensor spanning several programs,
in-place and ``out=`` modes, fp32 / fp16 / bf16 (the interpreter stores bf16 by truncation,
one ulp from round-to-nearest, so bf16 stores are compared within one ulp; fp16 exactly), NaN in
the last element of the last tensor, an inf made by the multiplication, chunked launches, and
determinism (two runs bit-identical). The read-only pass (``norm_and_inf``): the same statistics
as the reference and as the writing pass into fp32, grads untouched; the pointer tables cached.
CPU tier: both variants compile for sm_90 with 128-bit loads (the read-only one stores no data).
GPU tier (``-m cuda``): the same natively, bf16 stores exact, and a tensor of more than 2^31
elements (int64 offsets).

What is exact is compared bit for bit: a stored value is one IEEE fp32 product rounded once to
its dtype (the same on every machine), the max |·| and the inf/NaN flag are those of the stored
values. The sum of squares, a sum of every element in an order of the kernel's own, is judged by
the rule of ``fastpar.tolerance`` (``_parity.agree``): against the float64 sum of the very
values the kernel stored (or read), within 4 x the error of torch's fp32 sum of them + a floor.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from _parity import agree

from fastpar.ops import backend
from fastpar.ops import unscale_norm as op

interpreter = pytest.mark.interpreter
cuda = pytest.mark.cuda
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from fastpar.kernels import unscale_norm as kernels  # defines kernels: import lazily

    return kernels


def _grads(n, seed, max_numel, dtypes=DTYPES, device="cpu"):
    """``n`` tensors of random sizes (an empty one and a size-1 one when n > 2)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if n > 2 and i == 0:
            numel = 0
        elif n > 2 and i == 1:
            numel = 1
        else:
            numel = int(torch.randint(0, max_numel, (1,), generator=gen))
        dtype = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
        out.append((torch.randn(numel, generator=gen) * 50).to(device=device, dtype=dtype))
    return out


def _run(grads, inv, mode, backend_name, **kw):
    """Run the op on clones under ``backend_name``; return (result, written tensors)."""
    grads = [g.clone() for g in grads]
    outs = None if mode == "inplace" else [torch.empty_like(g, dtype=torch.float32) for g in grads]
    with backend.use_backend(backend_name):
        result = op.unscale_and_norm(grads, inv, out=outs, **kw)
    return result, grads if outs is None else outs


def _expected_stored(grads, inv, dtypes):
    return [(g.double() * inv).float().to(dt) for g, dt in zip(grads, dtypes, strict=True)]


def _assert_stored(got, want, ulp_bf16: bool) -> None:
    """Bitwise equal (NaN matching NaN), or within one ulp for bf16 when ``ulp_bf16``."""
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(torch.isnan(g), torch.isnan(w))
        g, w = g.masked_fill(torch.isnan(g), 0), w.masked_fill(torch.isnan(w), 0)
        if ulp_bf16 and g.dtype == torch.bfloat16:
            bits = (g.view(torch.int16).int() - w.view(torch.int16).int()).abs()
            assert bits.numel() == 0 or int(bits.max()) <= 1
        else:
            assert torch.equal(g, w)


def _same(a: float, b: float) -> bool:
    """Equal, NaN matching NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def _assert_stats(got, want, values, norm: bool = True) -> None:
    """(found_inf, sum of squares, max |·|) of a pass over ``values`` (what it stored, or the
    fp32 products it read): the flag as the reference's, the max exactly that of the values,
    the sum of squares by the rule against the float64 sum (torch's fp32 sum as the single)."""
    found, sumsq, amax = got
    assert _same(float(found), float(want[0])), (float(found), float(want[0]))
    flat = [v.reshape(-1) for v in values if v.numel()]
    if not flat:
        assert float(sumsq) == float(amax) == 0.0
        return
    top = float(torch.stack([v.double().abs().max() for v in flat]).max())  # NaN if any is
    assert _same(float(amax), top), (float(amax), top)
    if not norm:
        assert float(sumsq) == 0.0
        return
    single = torch.stack([v.float().square().sum() for v in flat]).sum()
    exact = torch.stack([v.double().square().sum() for v in flat]).sum()
    agree(sumsq, single, exact, "sum of squares", length=sum(v.numel() for v in flat))


def _compare(grads, inv, mode, device, **kw):
    """Triton vs the reference, the stored values vs float64 math, the statistics vs the stored
    values."""
    interpreting = device == "cpu"
    inv_f = float(torch.tensor(float(inv), dtype=torch.float32))
    dtypes = [g.dtype if mode == "inplace" else torch.float32 for g in grads]
    got, written = _run(grads, inv, mode, "triton", **kw)
    want, ref_written = _run(grads, inv, mode, "reference", **kw)
    _assert_stored(written, _expected_stored(grads, inv_f, dtypes), ulp_bf16=interpreting)
    bf16_stored = any(w.dtype == torch.bfloat16 for w in written)
    if not (interpreting and bf16_stored):  # truncated bf16 stores: values up to one ulp off
        _assert_stored(written, ref_written, ulp_bf16=False)
    _assert_stats(got, want, written, norm=kw.get("norm", True))  # of the values it stored
    return got, written


# --- interpreter tier ------------------------------------------------------------------------

DTYPE_SETS = {"fp32": (torch.float32,), "fp16": (torch.float16,), "bf16": (torch.bfloat16,)}
DTYPE_SETS["mixed"] = DTYPES
# 1,000 tensors once, with mixed dtypes and at most 40 elements each (interpreter time)
INTERP_CASES = [(n, k) for n in (1, 7) for k in DTYPE_SETS] + [(1000, "mixed")]


@interpreter
@pytest.mark.parametrize("mode", ["inplace", "out"])
@pytest.mark.parametrize(("n", "kind"), INTERP_CASES, ids=[f"{n}-{k}" for n, k in INTERP_CASES])
def test_interp_matches_reference(n, kind, mode):
    grads = _grads(n, seed=n, max_numel={1: 5000, 7: 3000, 1000: 40}[n], dtypes=DTYPE_SETS[kind])
    _compare(grads, 1.0 / 3.0, mode, "cpu")


@interpreter
@pytest.mark.parametrize("mode", ["inplace", "out"])
def test_interp_several_programs_per_tensor(mode):
    chunk, block = _kernels().CHUNK, _kernels().BLOCK
    grads = [torch.randn(2 * chunk + 17), torch.randn(chunk).half(), torch.randn(3)]
    grads += [torch.randn(3 * block).bfloat16(), torch.randn(block), torch.randn(block - 1)]
    _compare(grads, torch.tensor(2.0**-10), mode, "cpu")


@interpreter
def test_interp_unaligned_views():
    flat = torch.randn(3 * _kernels().BLOCK + 11)
    grads = [flat[1:2001], flat[2001:], torch.randn(100)]  # 4-byte aligned only, and aligned
    assert grads[0].data_ptr() % 16 != 0 and grads[2].data_ptr() % 16 == 0
    _compare(grads, 0.5, "inplace", "cpu")
    _compare(grads, 0.5, "out", "cpu")


@interpreter
@pytest.mark.parametrize("mode", ["inplace", "out"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_interp_nan_in_last_element_of_last_tensor(mode, dtype):
    grads = [*_grads(7, seed=1, max_numel=3000), torch.randn(_kernels().BLOCK + 5).to(dtype)]
    grads[-1][-1] = float("nan")
    (found, sumsq, amax), written = _compare(grads, 0.5, mode, "cpu")
    assert float(found) == 1.0 and math.isnan(float(sumsq)) and math.isnan(float(amax))
    assert math.isnan(float(written[-1][-1]))


@interpreter
def test_interp_inf_made_by_multiplication_and_found_inf():
    grads = [torch.randn(100), torch.tensor([1.0, 1e38, 2.0])]  # 1e38 · 10 = inf in fp32
    (found, sumsq, amax), _ = _compare(grads, 10.0, "inplace", "cpu")
    assert float(found) == 1.0 and float(amax) == math.inf and float(sumsq) == math.inf
    grads = [torch.tensor([6e4, -1.0], dtype=torch.float16)]  # 6e4 · 2 overflows fp16 ...
    (found, _, _), written = _compare(grads, 2.0, "inplace", "cpu")
    assert float(found) == 1.0 and written[0][0] == math.inf
    (found, _, _), written = _compare(grads, 2.0, "out", "cpu")  # ... but not fp32
    assert float(found) == 0.0 and float(written[0][0]) == 1.2e5
    flag = torch.ones(())
    with backend.use_backend("triton"):
        got = op.unscale_and_norm([torch.randn(10)], 1.0, found_inf=flag)
    assert got[0] is flag and float(flag) == 1.0  # accumulates, never reset


@interpreter
def test_interp_empty_norm_false_non_contiguous():
    with backend.use_backend("triton"):
        assert [float(t) for t in op.unscale_and_norm([], 0.5)] == [0.0, 0.0, 0.0]
        empty = op.unscale_and_norm([torch.empty(0), torch.empty(0, 3).half()], 0.5)
        assert [float(t) for t in empty] == [0.0, 0.0, 0.0]
    grads = _grads(7, seed=2, max_numel=3000, dtypes=(torch.float32, torch.float16))
    got, _ = _compare(grads, 0.25, "inplace", "cpu", norm=False)
    assert float(got[1]) == 0.0
    grads = [torch.randn(40, 30).t(), torch.randn(100), torch.randn(9, 9)[:, ::2]]
    _compare(grads, 0.25, "inplace", "cpu")  # non-contiguous ones take the reference


@interpreter
def test_interp_deterministic_and_chunked_launch():
    grads = _grads(30, seed=3, max_numel=6000, dtypes=(torch.float32, torch.float16))
    grads.append(torch.randn(3 * _kernels().CHUNK))
    inv = torch.tensor(1.0 / 3.0)
    outs = [[torch.empty_like(g, dtype=torch.float32) for g in grads] for _ in range(3)]
    k = _kernels()
    a = k.unscale_stats(grads, outs[0], inv)
    b = k.unscale_stats(grads, outs[1], inv)
    c = k.unscale_stats(grads, outs[2], inv, max_programs=2)  # many launches, one buffer
    # bit for bit: the same kernel on the same inputs, its partial sums reduced in one fixed
    # order whatever the launches
    for x, y, z in zip(a, b, c, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(*outs, strict=True))


# --- interpreter tier: the read-only pass and the cached tables ------------------------------


def _read(grads, inv, backend_name, **kw):
    """``norm_and_inf`` on clones under ``backend_name``; asserts the grads are untouched."""
    clones = [g.clone() for g in grads]
    with backend.use_backend(backend_name):
        result = op.norm_and_inf(clones, inv, **kw)
    _assert_stored(clones, grads, ulp_bf16=False)
    return result


def _compare_read(grads, inv, **kw):
    """Triton's read-only pass vs the reference's, and vs the writing pass into fp32 outs
    (the reference: bit for bit, the same products and sums; Triton's: the statistics of the
    same fp32 products, partial sums in another order)."""
    got = _read(grads, inv, "triton", **kw)
    want = _read(grads, inv, "reference", **kw)
    written, _ = _run(grads, inv, "out", "reference", **kw)
    for a, b in zip(want, written, strict=True):
        assert torch.equal(a, b) or (torch.isnan(a) and torch.isnan(b))
    inv_t = torch.as_tensor(inv, dtype=torch.float32)
    products = [g.float() * inv_t.to(g.device) for g in grads]  # IEEE products, as the kernel's
    _assert_stats(got, want, products, norm=kw.get("norm", True))
    return got


@interpreter
@pytest.mark.parametrize(("n", "kind"), INTERP_CASES, ids=[f"{n}-{k}" for n, k in INTERP_CASES])
def test_interp_read_only_matches_reference(n, kind):
    grads = _grads(n, seed=n, max_numel={1: 5000, 7: 3000, 1000: 40}[n], dtypes=DTYPE_SETS[kind])
    _compare_read(grads, 1.0 / 3.0)


@interpreter
def test_interp_read_only_programs_views_nan_inf_and_flags():
    k = _kernels()
    grads = [torch.randn(2 * k.CHUNK + 17), torch.randn(k.CHUNK).half(), torch.randn(3)]
    grads += [torch.randn(3 * k.BLOCK).bfloat16(), torch.randn(k.BLOCK - 1)]
    flat = torch.randn(3 * k.BLOCK + 11)
    grads += [flat[1:2001], flat[2001:]]  # not 16-byte aligned: the unhinted group
    _compare_read(grads, torch.tensor(2.0**-10))
    grads[-1][-1] = float("nan")
    found, sumsq, amax = _compare_read(grads, 0.5)
    assert float(found) == 1.0 and math.isnan(float(sumsq)) and math.isnan(float(amax))
    found, sumsq, amax = _compare_read([torch.randn(100), torch.tensor([1.0, 1e38])], 10.0)
    assert float(found) == 1.0 and float(amax) == math.inf and float(sumsq) == math.inf
    found, _, amax = _compare_read([torch.tensor([6e4, -1.0], dtype=torch.float16)], 2.0)
    assert float(found) == 0.0 and float(amax) == 1.2e5  # fp32 products: no fp16 overflow
    flag = torch.ones(())
    with backend.use_backend("triton"):
        got = op.norm_and_inf([torch.randn(10)], 1.0, found_inf=flag)
        assert got[0] is flag and float(flag) == 1.0  # accumulates, never reset
        assert [float(t) for t in op.norm_and_inf([], 0.5)] == [0.0, 0.0, 0.0]
        assert [float(t) for t in op.norm_and_inf([torch.empty(0, 3).half()], 0.5)] == [0] * 3
    assert float(_compare_read(_grads(7, seed=2, max_numel=3000), 0.25, norm=False)[1]) == 0.0
    strided = [torch.randn(40, 30).t(), torch.randn(100), torch.randn(9, 9)[:, ::2].half()]
    _compare_read(strided, 0.25)  # non-contiguous ones take the reference


@interpreter
def test_interp_read_only_deterministic_chunked_and_tables_cached(monkeypatch):
    k = _kernels()
    k._TABLES.clear()
    built = []
    real = k._build_table
    monkeypatch.setattr(k, "_build_table", lambda *a: built.append(1) or real(*a))
    grads = _grads(30, seed=3, max_numel=6000, dtypes=(torch.float32, torch.float16))
    grads.append(torch.randn(3 * k.CHUNK))
    inv = torch.tensor(1.0 / 3.0)
    a = k.unscaled_stats(grads, inv)
    b = k.unscaled_stats(grads, inv)
    assert len(built) == 1  # the second call reused the device table
    c = k.unscaled_stats(grads, inv, max_programs=2)  # many launches, one table
    # bit for bit: the same kernel on the same inputs, partial sums in one fixed order
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c, strict=True))
    assert len(built) == 1
    outs = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    k.unscale_stats(grads, outs, inv)  # other destinations: another table
    k.unscale_stats(grads, outs, inv)
    assert len(built) == 2
    fresh = [g.clone() for g in grads]  # new gradients (a new backward): a new table, still right
    assert all(torch.equal(x, y) for x, y in zip(k.unscaled_stats(fresh, inv), a, strict=True))
    assert len(built) == 3
    alive = [torch.randn(5) for _ in range(k.TABLE_CACHE_SIZE + 2)]  # distinct pointers
    for g in alive:
        k.unscaled_stats([g], inv)
    assert len(k._TABLES) == k.TABLE_CACHE_SIZE


def test_device_tables_are_keyed_by_pointers_and_numels():
    """CPU tier (no launch): the table of a set of groups is built once, laid out as
    ``[src | dst | numel]`` per group then the block maps, and bounded in number."""
    k = _kernels()
    k._TABLES.clear()
    cpu = torch.device("cpu")
    groups = [((16, 32), (16, 32), (5, 300)), ((48,), (64,), (256,))]
    table, layout = k._device_table(groups, 256, cpu)
    assert k._device_table([tuple(g) for g in groups], 256, cpu)[0] is table
    assert layout == [(0, 2, 0, 3), (6, 1, 3, 1)]  # 5 and 300 elements: 1 + 2 blocks; then 1
    assert table.tolist() == [16, 32, 16, 32, 5, 300, 48, 64, 256, 0, 1, 1, 0, 0, 0, 256, 0]
    assert k._device_table(groups, 512, cpu)[0] is not table  # another chunk: another table
    assert k._device_table(groups[:1], 256, cpu)[0] is not table


# --- CPU tier: the kernel compiles for a GPU (no GPU needed) ----------------------------------


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the real JIT")
def test_compiles_for_sm90_with_wide_accesses():
    """Ahead-of-time compile for sm_90: aligned groups must get 128-bit loads and stores."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this Triton has no ahead-of-time compile API: {exc}")
    import triton.language as tl

    k = _kernels()
    sig = {name: "*i64" for name in ("src_ptrs", "dst_ptrs", "numels", "block_tensor")}
    sig |= {"block_start": "*i64", "inv_ptr": "*fp32", "sumsq_ptr": "*fp32", "max_ptr": "*fp32"}
    cases = [(tl.float32, tl.float32, True), (tl.bfloat16, tl.bfloat16, True)]
    cases += [(tl.float32, tl.float32, False), (tl.bfloat16, tl.float32, False)]
    for src, dst, write in cases:
        consts = dict(SRC_DTYPE=src, DST_DTYPE=dst, ALIGNED=True, NORM=True, WRITE=write)
        consts |= dict(CHUNK=k.CHUNK, BLOCK=k.BLOCK)
        full = sig | {c: "constexpr" for c in consts}
        source = ASTSource(
            k._unscale_norm_kernel,
            full,
            constexprs={(list(full).index(c),): v for c, v in consts.items()},
            attrs={(i,): [["tt.divisibility", 16]] for i in range(len(sig))},
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": k.NUM_WARPS}
        )
        ptx = compiled.asm["ptx"]
        if write:
            assert "ld.global.v4" in ptx and "st.global.v4" in ptx, f"{src}: no 128-bit accesses"
        else:  # read-only: wide loads, and no vector store (only the two partial slots)
            assert "ld.global.v4" in ptx and "st.global.v4" not in ptx, f"{src}: read-only"
            assert ptx.count("st.global") <= 4, f"{src}: the read-only pass stores data"


# --- GPU tier ------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("mode", ["inplace", "out"])
@pytest.mark.parametrize("n", [1, 7, 1000, 5000])
@pytest.mark.parametrize("kind", list(DTYPE_SETS))
def test_cuda_matches_reference(n, mode, kind):
    grads = _grads(n, seed=n, max_numel=200_000 if n < 1000 else 3000, dtypes=DTYPE_SETS[kind])
    _compare([g.cuda() for g in grads], torch.tensor(1.0 / 3.0, device="cuda"), mode, "cuda")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_nan_inf_and_determinism(dtype):
    grads = _grads(50, seed=4, max_numel=100_000, device="cuda", dtypes=(dtype,))
    grads.append(torch.randn(100_003, device="cuda").to(dtype))
    r1, _ = _run(grads, 0.5, "out", "triton")
    r2, _ = _run(grads, 0.5, "out", "triton")
    assert all(torch.equal(x, y) for x, y in zip(r1, r2, strict=True))
    grads[-1][-1] = float("nan")
    (found, sumsq, amax), _ = _compare(grads, 0.5, "inplace", "cuda")
    assert float(found) == 1.0 and math.isnan(float(sumsq)) and math.isnan(float(amax))


@cuda
def test_cuda_more_than_2_31_elements():
    n = 2**31 + 4099
    big = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    big[-1] = 3.0
    with backend.use_backend("triton"):
        found, sumsq, amax = op.unscale_and_norm([big, torch.ones(3, device="cuda")], 2.0)
    assert float(found) == 0.0 and float(amax) == 6.0
    assert float(sumsq) == pytest.approx(4.0 * (n - 1) + 36.0 + 12.0, rel=1e-5)
    assert float(big[-1]) == 6.0 and float(big[n // 2]) == 2.0 and float(big[2**31 + 1]) == 2.0


@cuda
@pytest.mark.parametrize("kind", list(DTYPE_SETS))
def test_cuda_read_only_matches_reference(kind):
    grads = _grads(1000, seed=5, max_numel=3000, dtypes=DTYPE_SETS[kind])
    grads += [torch.randn(100_003).to(DTYPE_SETS[kind][0])]
    _compare_read([g.cuda() for g in grads], torch.tensor(1.0 / 3.0, device="cuda"))


@cuda
def test_cuda_read_only_pass_is_captured_in_a_cuda_graph():
    """After one call (the table cached), the pass captures and replays like eager calls."""
    grads = [
        torch.randn(n, device="cuda").to(dt)
        for n, dt in ((5000, torch.bfloat16), (77, torch.float32))
    ]
    inv, flag = torch.tensor(0.5, device="cuda"), torch.zeros((), device="cuda")
    with backend.use_backend("triton"):
        op.norm_and_inf(grads, inv)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, sumsq, amax = op.norm_and_inf(grads, inv, found_inf=flag)
        for g in grads:
            g.mul_(3.0)
        graph.replay()
        want = op.norm_and_inf(grads, inv)
    torch.cuda.synchronize()
    assert float(flag) == 0.0 and torch.equal(sumsq, want[1]) and torch.equal(amax, want[2])
