"""Triton kernels of MoE permute / unpermute.

Interpreter tier (``TRITON_INTERPRET=1``, fp32 CPU tensors): each launcher against the torch
reference on adversarial routings (everything to one expert with capacity below the routed
count, empty experts, k = 1 and 2, T = 1, a hidden size that is not a multiple of the block),
writes into a guarded buffer (nothing outside the output may change), and the whole op forward
and backward under ``backend.use_backend("triton")`` against the reference backend.
GPU tier (``-m cuda``): the same natively in fp32 / bf16 / fp16, and more than 2^31 elements.
CPU tier: the kernels compile for a Hopper GPU (no GPU needed).

Permute only moves rows: compared bit for bit. What sums or multiplies (unpermute, its backward,
the op's outputs and gradients) is judged by the rule of ``fastpar.tolerance``
(``_parity.agree``): the error against the reference run on float64 inputs (which it computes in
float64) at most 4 x the fp32 reference's own + a floor; lengths: k for a sum over the choices,
H for a dot product over the hidden size, 1 for one product.
"""

from __future__ import annotations

import os

import pytest
import torch
from _ce import ptxas_usage
from _parity import agree

from fastpar.ops import backend
from fastpar.ops.moe_permute import moe_permute, moe_unpermute
from fastpar.reference import moe_permute as ref

interpreter = pytest.mark.interpreter
cuda = pytest.mark.cuda
SENTINEL = 12345.0


def _kernels():
    from fastpar.kernels import moe_permute as kernels  # defines kernels: import lazily

    return kernels


def _routing(kind: str, t: int, k: int, e: int, seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "one_expert":
        ids = torch.full((t, k), e - 1, dtype=torch.int64)
    elif kind == "empty_experts":
        ids = torch.tensor([1, 3])[torch.randint(0, 2, (t, k), generator=gen)]
    else:
        ids = torch.randint(0, e, (t, k), generator=gen)
    return ids.to(device)


CASES = [  # (kind, T, k, E, capacity, H, block_h)
    ("random", 1, 1, 4, 1, 123, None),
    ("random", 1, 2, 4, None, 123, 32),
    ("random", 13, 2, 4, 3, 123, 32),  # 123 = 3·32 + 27: a ragged last block
    ("random", 13, 1, 4, 5, 123, 16),
    ("one_expert", 16, 2, 4, 3, 123, 32),  # 32 routed to one expert, 3 fit
    ("one_expert", 9, 1, 3, None, 40, 16),
    ("empty_experts", 11, 2, 6, 4, 123, None),
    ("empty_experts", 11, 2, 6, None, 33, 16),
    ("random", 8, 2, 4, 0, 20, 16),  # capacity 0: everything dropped
    ("random", 10, 3, 5, 4, 50, 16),  # k = 3
    ("random", 7, 8, 16, 3, 300, 128),  # k = 8, H = 2·128 + 44: ragged last hidden block
    ("one_expert", 5, 8, 4, 2, 70, 32),  # k = 8, 40 pairs for 2 rows
    ("random", 6, 8, 8, None, 300, None),  # k = 8 dropless, the default block (one block)
    ("random", 3, 8, 8, 2, 1100, None),  # k = 8, default block 1024: two blocks, ragged
]
IDS = [f"{c[0]}-T{c[1]}-k{c[2]}-E{c[3]}-C{c[4]}-H{c[5]}-B{c[6]}" for c in CASES]


def _setup(kind, t, k, e, capacity, h, seed=0, dtype=torch.float32, device="cpu"):
    ids = _routing(kind, t, k, e, seed, device)
    slots, _, kept, _, _ = ref.compute_slots(ids, e, capacity)
    rows = t * k if capacity is None else e * capacity
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, h, generator=gen).to(device=device, dtype=dtype)
    src = torch.randn(rows, h, generator=gen).to(device=device, dtype=dtype)
    probs = torch.rand(t, k, generator=gen).to(device)
    g = torch.randn(t, h, generator=gen).to(device=device, dtype=dtype)
    return slots, kept, rows, x, src, probs, g


def _guarded(rows: int, h: int, dtype=torch.float32, device="cpu", pad: int = 3):
    """(buffer with ``pad`` sentinel rows either side, the ``[rows, h]`` view between them)."""
    buf = torch.full((rows + 2 * pad, h), SENTINEL, dtype=dtype, device=device)
    return buf, buf[pad : pad + rows]


def _guards_intact(buf: torch.Tensor, pad: int = 3) -> bool:
    return bool((buf[:pad] == SENTINEL).all() and (buf[buf.shape[0] - pad :] == SENTINEL).all())


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def _exact_backward(g, src, slots, probs, kept, capacity):
    """The reference backward in float64 from the same values: (d src, d probs)."""
    return ref.unpermute_backward(g.double(), src.double(), slots, probs.double(), kept, capacity)


# --- interpreter tier: launchers against the reference --------------------------------------


@interpreter
@pytest.mark.parametrize(("kind", "t", "k", "e", "capacity", "h", "block_h"), CASES, ids=IDS)
def test_permute_kernel_matches_reference(kind, t, k, e, capacity, h, block_h):
    slots, kept, rows, x, _, _, _ = _setup(kind, t, k, e, capacity, h)
    buf, out = _guarded(rows, h)
    got = _kernels().permute(x, slots, kept, capacity, rows, block_h=block_h, out=out)
    want = ref.permute(x, slots, kept, capacity, rows)
    assert got.data_ptr() == out.data_ptr()
    assert got.equal(want)  # a copy: exact, unused rows exactly 0 (the sentinel is overwritten)
    assert _guards_intact(buf)
    fresh = _kernels().permute(x, slots, kept, capacity, rows, block_h=block_h)
    assert fresh.equal(want)


@interpreter
@pytest.mark.parametrize(("kind", "t", "k", "e", "capacity", "h", "block_h"), CASES, ids=IDS)
def test_unpermute_kernel_matches_reference(kind, t, k, e, capacity, h, block_h):
    slots, _, _, _, src, probs, _ = _setup(kind, t, k, e, capacity, h, seed=1)
    for name, weights in (("probs", probs), ("weight 1", None), ("fp64 probs", probs.double())):
        got = _kernels().unpermute(src, slots, weights, block_h=block_h)
        want = ref.unpermute(src, slots, weights)
        assert got.dtype == src.dtype
        exact = ref.unpermute(src.double(), slots, _f64(weights))
        agree(got, want, exact, f"unpermute, {name}", length=k)


@interpreter
@pytest.mark.parametrize(("kind", "t", "k", "e", "capacity", "h", "block_h"), CASES, ids=IDS)
def test_unpermute_backward_kernel_matches_reference(kind, t, k, e, capacity, h, block_h):
    slots, kept, rows, _, src, probs, g = _setup(kind, t, k, e, capacity, h, seed=2)
    want_src, want_probs = ref.unpermute_backward(g, src, slots, probs, kept, capacity)
    exact_src, exact_probs = _exact_backward(g, src, slots, probs, kept, capacity)
    buf, out = _guarded(rows, h)
    d_src, d_probs = _kernels().unpermute_backward(
        g, src, slots, probs, kept, capacity, block_h=block_h, out=out
    )
    agree(d_src, want_src, exact_src, "d src", length=1)
    agree(d_probs, want_probs, exact_probs, "d probs", length=h)
    assert (d_probs[slots < 0] == 0).all()
    assert _guards_intact(buf)
    only_probs = _kernels().unpermute_backward(
        g, src, slots, probs, kept, capacity, need_src=False, block_h=block_h
    )
    assert only_probs[0] is None
    agree(only_probs[1], want_probs, exact_probs, "d probs alone", length=h)
    only_src = _kernels().unpermute_backward(
        g, src, slots, probs, kept, capacity, need_probs=False, block_h=block_h
    )
    assert only_src[1] is None
    agree(only_src[0], want_src, exact_src, "d src alone", length=1)


@interpreter
def test_every_token_to_one_expert_writes_nothing_out_of_bounds():
    """Transformer Engine's Triton permute wrote out of bounds here (its report #3346)."""
    t, k, e, cap, h = 64, 2, 4, 5, 24
    ids = torch.full((t, k), 2, dtype=torch.int64)
    slots, _, kept, _, dropped = ref.compute_slots(ids, e, cap)
    assert int(dropped) == t * k - cap and kept.tolist() == [0, 0, 5, 0]
    x = torch.randn(t, h)
    buf, out = _guarded(e * cap, h, pad=8)
    _kernels().permute(x, slots, kept, cap, e * cap, block_h=16, out=out)
    assert _guards_intact(buf, pad=8)
    assert out.view(e, cap, h)[2].equal(x[:5]) and (out.view(e, cap, h)[[0, 1, 3]] == 0).all()


@interpreter
def test_low_precision_inputs_load_as_fp32():
    """fp16 rows load as fp32 in the interpreter and fp16 stores are exact there."""
    slots, kept, rows, x, src, probs, g = _setup("random", 9, 2, 3, 4, 50, seed=3)
    xh, srch, gh = x.half(), src.half(), g.half()
    assert (
        _kernels()
        .permute(xh, slots, kept, 4, rows, block_h=16)
        .equal(ref.permute(xh, slots, kept, 4, rows))
    )
    ph, fp16 = probs.half(), torch.float16
    got = _kernels().unpermute(srch, slots, ph, block_h=16)
    exact = ref.unpermute(srch.double(), slots, ph.double())
    agree(got, ref.unpermute(srch, slots, ph), exact, "fp16 unpermute", length=2, dtype=fp16)
    d_src, d_probs = _kernels().unpermute_backward(gh, srch, slots, ph, kept, 4)
    w_src, w_probs = ref.unpermute_backward(gh, srch, slots, ph, kept, 4)
    e_src, e_probs = _exact_backward(gh, srch, slots, ph, kept, 4)
    assert d_src.dtype == torch.float16 and d_probs.dtype == torch.float16
    agree(d_src, w_src, e_src, "fp16 d src", length=1, dtype=fp16)
    agree(d_probs, w_probs, e_probs, "fp16 d probs", length=50, dtype=fp16)


# --- interpreter tier: the whole op under Triton against the reference backend ----------------

OP_CASES = [  # (kind, T, k, E, capacity, H)
    ("random", 1, 1, 3, 2, 123),
    ("random", 21, 2, 4, 6, 123),
    ("one_expert", 12, 2, 3, 4, 57),
    ("empty_experts", 10, 2, 5, None, 123),
    ("random", 15, 1, 4, None, 123),
    ("random", 9, 8, 16, 4, 300),  # k = 8
    ("random", 9, 8, 16, None, 1100),  # k = 8 dropless, two hidden blocks
]


def _run_op(x, ids, e, capacity, probs, g, order=None):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    out, info = moe_permute(x, ids, e, capacity, order=order)
    y = moe_unpermute(out * 1.5, probs, info)
    y.backward(g)
    return out.detach(), y.detach(), x.grad, probs.grad, info


def _agree_op(got, want, exact, where: str, k: int, h: int) -> None:
    """The op's (permuted rows, output, d x, d probs): the rows bit for bit (a copy), the rest
    by the rule (sums over the choices, and d probs a dot product over H)."""
    assert got[0].equal(want[0]), f"{where}: permuted rows"
    assert got[4].slots.cpu().equal(want[4].slots), f"{where}: slots"
    for name, n, a, b, c in zip(
        ("output", "d x", "d probs"), (k, k, h), got[1:4], want[1:4], exact[1:4], strict=True
    ):
        agree(a, b, c, f"{where}: {name}", length=n)


@interpreter
@pytest.mark.parametrize(("kind", "t", "k", "e", "capacity", "h"), OP_CASES)
def test_op_under_triton_matches_reference(kind, t, k, e, capacity, h):
    ids = _routing(kind, t, k, e, seed=4)
    gen = torch.Generator().manual_seed(5)
    x, probs, g = torch.randn(t, h, generator=gen), torch.rand(t, k), torch.randn(t, h)
    order = torch.randperm(t * k, generator=gen) if kind == "random" and k == 2 else None
    with backend.use_backend("triton"):
        got = _run_op(x, ids, e, capacity, probs, g, order)
    with backend.use_backend("reference"):
        want = _run_op(x, ids, e, capacity, probs, g, order)
        exact = _run_op(x.double(), ids, e, capacity, probs.double(), g.double(), order)
    _agree_op(got, want, exact, "triton", k, h)


@interpreter
def test_triton_is_deterministic():
    ids = _routing("random", 30, 2, 4, seed=6)
    x, probs, g = torch.randn(30, 70), torch.rand(30, 2), torch.randn(30, 70)
    with backend.use_backend("triton"):
        a = _run_op(x, ids, 4, None, probs, g)
        b = _run_op(x, ids, 4, None, probs, g)
    for u, v in zip(a[:4], b[:4], strict=True):  # the same kernels on the same inputs
        assert u.equal(v)


# --- GPU tier -----------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("kind", "t", "k", "e", "capacity", "h"),
    [
        ("random", 1, 1, 4, 1, 123),
        ("random", 4096, 2, 8, 1280, 1024),
        ("random", 4093, 2, 64, None, 2050),
        ("one_expert", 3000, 2, 8, 100, 123),
        ("empty_experts", 777, 1, 8, None, 4096),
        ("random", 1024, 8, 64, 160, 7168),  # k = 8 at DeepSeek-V3's hidden size
        ("random", 999, 8, 32, None, 7000),  # k = 8 dropless, a ragged last hidden block
    ],
)
def test_cuda_kernels_match_reference(dtype, kind, t, k, e, capacity, h):
    slots, kept, rows, x, src, probs, g = _setup(kind, t, k, e, capacity, h, 7, dtype, "cuda")
    kern = _kernels()
    buf, out = _guarded(rows, h, dtype, "cuda")
    kern.permute(x, slots, kept, capacity, rows, out=out)
    assert out.equal(ref.permute(x, slots, kept, capacity, rows))  # a copy
    assert _guards_intact(buf)
    got = kern.unpermute(src, slots, probs)
    assert got.dtype == dtype
    exact = ref.unpermute(src.double(), slots, probs.double())
    agree(got, ref.unpermute(src, slots, probs), exact, "unpermute", length=k, dtype=dtype)
    got_dx = kern.unpermute(src, slots, None)
    exact = ref.unpermute(src.double(), slots, None)
    agree(
        got_dx, ref.unpermute(src, slots, None), exact, "unpermute, weight 1", length=k, dtype=dtype
    )
    buf, out = _guarded(rows, h, dtype, "cuda")
    d_src, d_probs = kern.unpermute_backward(g, src, slots, probs, kept, capacity, out=out)
    w_src, w_probs = ref.unpermute_backward(g, src, slots, probs, kept, capacity)
    e_src, e_probs = _exact_backward(g, src, slots, probs, kept, capacity)
    assert _guards_intact(buf)
    agree(d_src, w_src, e_src, "d src", length=1, dtype=dtype)
    agree(d_probs, w_probs, e_probs, "d probs", length=h)  # probs are fp32


@cuda
def test_cuda_op_matches_reference_on_cpu():
    ids = _routing("random", 2048, 2, 16, seed=8, device="cuda")
    x = torch.randn(2048, 1000, device="cuda")
    probs, g = torch.rand(2048, 2, device="cuda"), torch.randn(2048, 1000, device="cuda")
    got = _run_op(x, ids, 16, 300, probs, g)
    cpu = [t.cpu() for t in (x, ids, probs, g)]
    want = _run_op(cpu[0], cpu[1], 16, 300, cpu[2], cpu[3])
    exact = _run_op(cpu[0].double(), cpu[1], 16, 300, cpu[2].double(), cpu[3].double())
    got = (*[t.cpu() for t in got[:4]], got[4])
    _agree_op(got, want, exact, "cuda against the CPU reference", 2, 1000)


@cuda
def test_cuda_more_than_2_31_elements():
    """int64 row offsets: a dropless buffer of 65536·2 rows × 16896 bf16 (> 2^31 elements)."""
    t, k, e, h = 65536, 2, 8, 16896
    assert t * k * h > 2**31
    ids = _routing("random", t, k, e, seed=9, device="cuda")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    out, info = moe_permute(x, ids, e, None)
    last = info.slots.view(-1).argmax()  # the pair in the last row
    tok = int(last) // k
    assert out[-1].equal(x[tok])
    y = moe_unpermute(out, torch.full((t, k), 0.5, device="cuda"), info)
    torch.testing.assert_close(y[-4:].float(), x[-4:].float(), rtol=1e-2, atol=1e-2)


# --- CPU tier: the kernels compile for a Hopper GPU (no GPU needed) -----------------------------

REGISTER_BUDGET = 64  # per thread: every kernel is a streaming copy / reduction
PTR, INT = ("src_ptr", "slots_ptr", "w_ptr", "out_ptr", "other_ptr", "dot_ptr", "kept_ptr"), "i32"


def _signatures(dtype: str) -> dict:
    scatter = {
        "src_ptr": f"*{dtype}",
        "slots_ptr": "*i64",
        "w_ptr": "*fp32",
        "out_ptr": f"*{dtype}",
        "other_ptr": f"*{dtype}",
        "dot_ptr": "*fp32",
        "H": INT,
        "src_stride": INT,
        "out_stride": INT,
        "other_stride": INT,
    }
    gather = {
        "src_ptr": f"*{dtype}",
        "slots_ptr": "*i64",
        "w_ptr": "*fp32",
        "out_ptr": f"*{dtype}",
        "H": INT,
        "src_stride": INT,
        "out_stride": INT,
    }
    zero = {"out_ptr": f"*{dtype}", "kept_ptr": "*i64", "C": INT, "H": INT, "out_stride": INT}
    return {"_scatter_kernel": scatter, "_gather_kernel": gather, "_zero_rows_kernel": zero}


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="compiles kernels: not under the interpreter"
)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_kernels_compile_for_sm90(dtype, k, tmp_path):
    """Compiled for sm_90 as a real launch at H = 7168 specialises them (16-byte aligned
    pointers, H and the row strides divisible by 16): no spills, at most ``REGISTER_BUDGET``
    registers, and 128-bit global loads and stores of the rows, for k up to 8 (the hidden block
    does not depend on k)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = _kernels()
    bh = kern._block_h(7168, None)
    assert bh == kern.MAX_BLOCK_H  # the block of a long row, whatever k is
    flags = {
        "_scatter_kernel": [
            {"HAS_W": False, "STORE": True, "DOT": False},
            {"HAS_W": True, "STORE": True, "DOT": True},
            {"HAS_W": True, "STORE": False, "DOT": True},
        ],
        "_gather_kernel": [{"HAS_W": False}, {"HAS_W": True}],
        "_zero_rows_kernel": [{}],
    }
    for name, sig in _signatures(dtype).items():
        for extra in flags[name]:
            constexprs = {**extra, "BLOCK_H": bh}
            if name != "_zero_rows_kernel":
                constexprs["K"] = k
            full_sig = {**sig, **dict.fromkeys(constexprs, "constexpr")}
            aligned = [i for i, a in enumerate(sig) if a in PTR or a == "H" or "stride" in a]
            src = ASTSource(
                getattr(kern, name),
                signature=full_sig,
                constexprs=constexprs,
                attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
            )
            try:
                compiled = triton.compile(
                    src, target=GPUTarget("cuda", 90, 32), options={"num_warps": kern._warps(bh)}
                )
            except RuntimeError as exc:
                if "ptxas" in str(exc) and "not found" in str(exc):
                    pytest.skip(f"no ptxas: {exc}")
                raise
            what = (name, extra)
            assert "cubin" in compiled.asm, what
            ptx = compiled.asm["ptx"]
            regs, spills = ptxas_usage(ptx, tmp_path)
            assert spills == 0, (what, spills)
            assert regs <= REGISTER_BUDGET, (what, regs)
            if name == "_zero_rows_kernel" or extra.get("STORE", True):
                assert "st.global.v4" in ptx, (what, "no 128-bit stores")
            if name != "_zero_rows_kernel":
                assert "ld.global.v4" in ptx, (what, "no 128-bit loads")
