"""The dropless experts' paths (``fastpar.moe.experts.set_segments_impl``: "grouped" — the
default — and "padded") against the per-expert "loop" (itself bit for bit the indexed loop it
replaced): output and every gradient (x, w1, b1,
w2, b2), gated and plain, with and without biases, with empty experts, every row on one
expert and no rows at all; fp32 and bf16; then the ``MoE`` layer (dropless) under each forced
path, and under ``torch.compile`` (which always traces the grouped path).

Tolerances. fp32: 1e-5 (relative and absolute, values of order 1), not bit for bit: the
matmuls agree exactly, but the activation then runs over tensors of other sizes (one per
expert in the loop, all rows at once otherwise) and CPU's vectorised loops round their tail
elements differently (1 ulp); with ReLU (exact) and no bias the paths agree bit for bit.
bf16: 2e-2 relative to each element plus 2e-2 of the tensor's largest value (each path rounds
the same intermediates to bf16, but a matmul of other shape can round one of them the other
way: a single gradient element of a short sum then moves by several ulps), and every path
within 1e-2 of a float64 run (relative to the tensor's largest value).
"""

from __future__ import annotations

import pytest
import torch

from fastpar.moe import MoE, experts

H, F, E = 16, 24, 4
COUNTS = {
    "mixed": [5, 0, 9, 3],  # one empty expert
    "one-expert": [0, 17, 0, 0],
    "no-rows": [0, 0, 0, 0],
}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
IMPLS = ["grouped", "padded"]


@pytest.fixture(autouse=True)
def _restore_impl():
    old = experts.get_segments_impl()
    yield
    experts.set_segments_impl(old)


def _inputs(counts, gated, bias, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    width = 2 * F if gated else F

    def leaf(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen) * scale
        return t.to(device=device, dtype=dtype).requires_grad_()

    x = leaf(sum(counts), H)
    w = (
        leaf(E, H, width, scale=H**-0.5),
        leaf(E, width) if bias else None,
        leaf(E, F, H, scale=F**-0.5),
        leaf(E, H) if bias else None,
    )
    grad = torch.randn(sum(counts), H, generator=gen).to(device=device, dtype=dtype)
    return x, w, grad


def _run(impl, x, counts, w, grad, gated, activation):
    """(y, grads of x, w1, b1, w2, b2 — None for an absent bias) under ``impl``."""
    experts.set_segments_impl(impl)
    y = experts.segments(x, counts, *w, gated, activation)
    params = [p for p in (x, *w) if p is not None]
    grads = iter(torch.autograd.grad(y, params, grad))
    return y, [None if p is None else next(grads) for p in (x, *w)]


def _close(a, b, dtype, exact, name):
    """fp32 ``TOL``; bf16: 2e-2 relative to each element and to the tensor's largest value."""
    if exact:
        tol = dict(rtol=0, atol=0)
    elif dtype == torch.bfloat16:
        tol = dict(rtol=2e-2, atol=2e-2 * max(b.abs().max().item(), 1e-3))
    else:
        tol = TOL[dtype]
    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


def _check(impl, counts, gated, bias, activation, dtype, device="cpu", exact=False):
    x, w, grad = _inputs(counts, gated, bias, dtype, device)
    want, want_grads = _run(
        "loop", x, torch.tensor(counts, device=device), w, grad, gated, activation
    )
    for c in (torch.tensor(counts, device=device), counts):  # counts as a tensor or a list
        y, grads = _run(impl, x, c, w, grad, gated, activation)
        assert y.shape == want.shape and y.dtype == dtype
        _close(y, want, dtype, exact, "y")
        for name, a, b in zip(("x", "w1", "b1", "w2", "b2"), grads, want_grads, strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                _close(a, b, dtype, exact, f"d{name}")
    return y, grads


def _error(got, want) -> float:
    """max |got - want| / max |want| (0 for empty tensors)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    return (got.double() - want).abs().max().item() / scale if scale else 0.0


def _indexed_loop(x, counts, w1, b1, w2, b2, gated, activation):
    """``segments`` eagerly on a CPU before issue 18 (weights indexed per expert)."""
    outs = []
    for e, part in enumerate(x.split(counts)):
        h = part @ w1[e] if b1 is None else part @ w1[e] + b1[e]
        h = experts.hidden(h, gated, activation)
        outs.append(h @ w2[e] if b2 is None else h @ w2[e] + b2[e])
    return torch.cat(outs)


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("gated,bias", [(False, True), (True, False), (True, True)])
def test_loop_equals_the_indexed_loop_it_replaced_bit_for_bit(gated, bias, counts):
    x, w, grad = _inputs(counts, gated, bias, torch.float32)
    act = "silu" if gated else "gelu"
    params = [p for p in (x, *w) if p is not None]
    want = _indexed_loop(x, counts, *w, gated, act)
    want_grads = torch.autograd.grad(want, params, grad)
    y, grads = _run("loop", x, counts, w, grad, gated, act)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for a, b in zip([g for g in grads if g is not None], want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_selector_returns_previous_and_rejects_unknown():
    assert experts.get_segments_impl() == "auto"
    assert experts.set_segments_impl("padded") == "auto"
    assert experts.set_segments_impl("loop") == "padded"
    assert experts.get_segments_impl() == "loop"
    with pytest.raises(ValueError, match="'bmm'"):
        experts.set_segments_impl("bmm")
    assert experts.get_segments_impl() == "loop"


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("gated,activation", [(False, "gelu"), (True, "silu")], ids=["mlp", "glu"])
@pytest.mark.parametrize("impl", [*IMPLS, "auto"])
def test_equals_loop_fp32(impl, gated, activation, bias, counts):
    _check(impl, counts, gated, bias, activation, torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_equals_loop_bit_for_bit_relu_without_bias(impl):
    _check(impl, COUNTS["mixed"], False, False, "relu", torch.float32, exact=True)


@pytest.mark.parametrize("counts", [COUNTS["mixed"], COUNTS["one-expert"]], ids=["mixed", "one"])
@pytest.mark.parametrize("gated,bias", [(False, True), (True, False)], ids=["mlp", "swiglu"])
@pytest.mark.parametrize("impl", IMPLS)
def test_equals_loop_bf16(impl, gated, bias, counts):
    """bf16 against the loop (``_close``), and both within 1e-2 of float64 (relative to each
    tensor's largest value; measured about 4e-3 for each path)."""
    act = "silu" if gated else "gelu"
    y, grads = _check(impl, counts, gated, bias, act, torch.bfloat16)
    x, w, grad = _inputs(counts, gated, bias, torch.bfloat16)
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in (x, *w)]
    ref, ref_grads = _run("loop", leaves[0], counts, leaves[1:], grad.double(), gated, act)
    loop, loop_grads = _run("loop", x, counts, w, grad, gated, act)
    for got, base, want in zip([y, *grads], [loop, *loop_grads], [ref, *ref_grads], strict=True):
        if want is not None:
            assert _error(got, want) < 1e-2 and _error(base, want) < 1e-2


def test_padded_takes_a_dtype_and_strides_grouped_mm_refuses():
    """float64 and a non-contiguous x (odd row stride): _grouped_mm refuses both; padded runs."""
    counts = [3, 0, 4, 2]
    x, w, grad = _inputs(counts, True, True, torch.float64)
    wide = torch.randn(sum(counts), H + 3, dtype=torch.float64)[:, :H].requires_grad_()
    for inp in (x, wide):
        want, want_grads = _run("loop", inp, counts, w, grad, True, "silu")
        y, grads = _run("padded", inp, counts, w, grad, True, "silu")
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _layer_step(impl, expert, bias, x):
    experts.set_segments_impl(impl)
    torch.manual_seed(0)
    moe = MoE(H, F, E, top_k=2, capacity_factor=None, expert=expert, bias=bias)
    y = moe(x)
    y.square().sum().backward()  # the aux loss enters backward by itself (aux_loss_in_backward)
    return y, x.grad, {n: p.grad for n, p in moe.named_parameters()}


@pytest.mark.parametrize("expert,bias", [("mlp", True), ("swiglu", False), ("glu", True)])
@pytest.mark.parametrize("impl", IMPLS)
def test_moe_layer_equal_under_each_impl(impl, expert, bias):
    x0 = torch.randn(2, 13, H, generator=torch.Generator().manual_seed(1))
    want = _layer_step("loop", expert, bias, x0.clone().requires_grad_())
    got = _layer_step(impl, expert, bias, x0.clone().requires_grad_())
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float32])
    torch.testing.assert_close(got[1], want[1], **TOL[torch.float32])
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, **TOL[torch.float32], msg=name)


def test_compiled_layer_traces_the_grouped_path_whatever_the_choice():
    """Under torch.compile a forced loop or padded path is not traced (each reads the counts
    on the host): one graph, equal to eager."""
    experts.set_segments_impl("loop")
    torch.manual_seed(0)
    moe = MoE(H, F, E, top_k=2, capacity_factor=None, expert="swiglu")
    moe.aux_loss_scale = 0.5  # a constant: no context lookup to trace (as test_moe_compile)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(2))
    want = moe(x)
    got = torch.compile(moe, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equals_loop_on_cuda(impl, dtype):
    """On a GPU ("grouped" is torch._grouped_mm in bf16; fp32 TF32 off by default)."""
    for counts in COUNTS.values():
        _check(impl, counts, True, False, "silu", dtype, device="cuda")
        _check(impl, counts, False, True, "gelu", dtype, device="cuda")
