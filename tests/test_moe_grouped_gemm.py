"""The dropless experts' paths (``fastpar.moe.experts.set_segments_impl``: "grouped" — the
default — and "padded") against the per-expert "loop" (itself bit for bit the indexed loop it
replaced): output and every gradient (x, w1, b1, w2, b2), gated and plain, with and without
biases, with empty experts, every row on one expert and no rows at all; fp32 and bf16; then the
``MoE`` layer (dropless) under each forced path, and under ``torch.compile`` (which always traces
the grouped path).

Tolerances: ``fastpar.tolerance``'s rule (docs/tolerances.md). Each path's error against the
loop run in float64 (the exact math) may be at most 4 x the loop's own error in the working
precision plus a floor (fp32: 2^-24, bf16: 2^-8, and fp32 accumulation over the longest sum).
The paths are not bit for bit: "padded" runs one batched matmul over [E, C, H] where the loop
runs one matmul per expert — different GEMMs, whose sums a CPU BLAS may block otherwise (1 ulp
here and there, depending on the machine) — and the activation then runs over tensors of other
sizes (a vectorised loop rounds its tail elements otherwise). Bit for bit is claimed only where
the same GEMMs run: "grouped" on a CPU calls the per-group matmul of the loop
(``torch._grouped_mm``'s CPU kernel: one ``mm`` per group on the same slices), and with ReLU
(exact) and no bias nothing else runs. bf16 also keeps an error bound against float64 stated
on purpose (1e-2 of each tensor's largest value for every path).
"""

from __future__ import annotations

import pytest
import torch
from _parity import agree, exact_copy

from fastpar.moe import MoE, experts

H, F, E = 16, 24, 4
COUNTS = {
    "mixed": [5, 0, 9, 3],  # one empty expert
    "one-expert": [0, 17, 0, 0],
    "no-rows": [0, 0, 0, 0],
}
IMPLS = ["grouped", "padded"]
LENGTH = max(sum(COUNTS["one-expert"]), H, 2 * F)  # the longest sum: rows, the widths


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


def _leaves64(x, w):
    """Float64 copies of the inputs, as new leaves: the exact math's."""
    return [None if t is None else t.detach().double().requires_grad_() for t in (x, *w)]


def _check(impl, counts, gated, bias, activation, dtype, device="cpu", exact=False):
    """``impl`` against the loop: by the rule against the loop in float64, or (``exact``) bit
    for bit against the loop in ``dtype``."""
    x, w, grad = _inputs(counts, gated, bias, dtype, device)
    c = torch.tensor(counts, device=device)
    want, want_grads = _run("loop", x, c, w, grad, gated, activation)
    x64, *w64 = _leaves64(x, w)
    ref, ref_grads = _run("loop", x64, c, w64, grad.double(), gated, activation)
    names = ("x", "w1", "b1", "w2", "b2")
    for c in (torch.tensor(counts, device=device), counts):  # counts as a tensor or a list
        y, grads = _run(impl, x, c, w, grad, gated, activation)
        assert y.shape == want.shape and y.dtype == dtype
        for name, a, b, e in zip(
            ("y", *names), [y, *grads], [want, *want_grads], [ref, *ref_grads], strict=True
        ):
            assert (a is None) == (b is None), name
            if a is None:
                continue
            if exact:  # the same GEMMs on the same slices, an exact activation: bit for bit
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
            else:
                agree(a, b, e, f"{impl}: {name}", length=LENGTH, dtype=dtype)
    return y, grads


def _error(got, want) -> float:
    """max |got - want| / max |want| (0 for empty tensors)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    return (got.double() - want).abs().max().item() / scale if scale else 0.0


def _indexed_loop(x, counts, w1, b1, w2, b2, gated, activation):
    """``segments`` eagerly on a CPU before the grouped GEMM (weights indexed per expert)."""
    outs = []
    for e, part in enumerate(x.split(counts)):
        h = part @ w1[e] if b1 is None else part @ w1[e] + b1[e]
        h = experts.hidden(h, gated, activation)
        outs.append(h @ w2[e] if b2 is None else h @ w2[e] + b2[e])
    return torch.cat(outs)


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("gated,bias", [(False, True), (True, False), (True, True)])
def test_loop_equals_the_indexed_loop_it_replaced_bit_for_bit(gated, bias, counts):
    """Bit for bit: both run the same matmuls on the same slices of the weights (a view from
    ``unbind`` or from indexing) and the same activation on the same tensors; their backwards
    differ only in adding zeros (indexing) or stacking (``unbind``), both exact."""
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
def test_relu_without_bias_grouped_bit_for_bit_padded_by_the_rule(impl):
    """With ReLU (exact) and no bias only the matmuls round. "grouped" equals the loop bit for
    bit: on a CPU ``torch._grouped_mm`` calls one ``mm`` per group on the slices the loop
    multiplies. "padded" does not: one ``bmm`` over the zero-padded [E, C, H] is another GEMM
    than the loop's per-expert ``mm`` (a BLAS blocks its sums by shape and machine: here 1 ulp
    on some elements), so it is judged by the rule against the loop in float64."""
    _check(impl, COUNTS["mixed"], False, False, "relu", torch.float32, exact=impl == "grouped")


@pytest.mark.parametrize("counts", [COUNTS["mixed"], COUNTS["one-expert"]], ids=["mixed", "one"])
@pytest.mark.parametrize("gated,bias", [(False, True), (True, False)], ids=["mlp", "swiglu"])
@pytest.mark.parametrize("impl", IMPLS)
def test_equals_loop_bf16(impl, gated, bias, counts):
    """bf16 against the loop by the rule (``_check``: the loop in bf16 and in float64), and both
    within 1e-2 of float64 (relative to each tensor's largest value; measured about 4e-3 for
    each path: a bound stated on purpose)."""
    act = "silu" if gated else "gelu"
    y, grads = _check(impl, counts, gated, bias, act, torch.bfloat16)
    x, w, grad = _inputs(counts, gated, bias, torch.bfloat16)
    leaves = _leaves64(x, w)
    ref, ref_grads = _run("loop", leaves[0], counts, leaves[1:], grad.double(), gated, act)
    loop, loop_grads = _run("loop", x, counts, w, grad, gated, act)
    for got, base, want in zip([y, *grads], [loop, *loop_grads], [ref, *ref_grads], strict=True):
        if want is not None:
            assert _error(got, want) < 1e-2 and _error(base, want) < 1e-2


def test_padded_takes_a_dtype_and_strides_grouped_mm_refuses():
    """float64 and a non-contiguous x (odd row stride): _grouped_mm refuses both; padded runs
    (float64 against float64: 1e-12 is far above float64's rounding on any machine)."""
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
    """Output, input grad and parameter grads of the layer under ``impl``, in ``x``'s dtype."""
    experts.set_segments_impl(impl)
    torch.manual_seed(0)
    moe = MoE(H, F, E, top_k=2, capacity_factor=None, expert=expert, bias=bias).to(x.dtype)
    y = moe(x)
    y.square().sum().backward()  # the aux loss enters backward by itself (aux_loss_in_backward)
    return y, x.grad, {n: p.grad for n, p in moe.named_parameters()}


@pytest.mark.parametrize("expert,bias", [("mlp", True), ("swiglu", False), ("glu", True)])
@pytest.mark.parametrize("impl", IMPLS)
def test_moe_layer_equal_under_each_impl(impl, expert, bias):
    x0 = torch.randn(2, 13, H, generator=torch.Generator().manual_seed(1))
    want = _layer_step("loop", expert, bias, x0.clone().requires_grad_())
    exact = _layer_step("loop", expert, bias, x0.double().requires_grad_())
    got = _layer_step(impl, expert, bias, x0.clone().requires_grad_())
    agree(got[0], want[0], exact[0], f"{impl}: output", length=LENGTH)
    agree(got[1], want[1], exact[1], f"{impl}: input grad", length=LENGTH)
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        agree(got[2][name], g, exact[2][name], f"{impl}: grad {name}", length=LENGTH)


def test_compiled_layer_traces_the_grouped_path_whatever_the_choice():
    """Under torch.compile a forced loop or padded path is not traced (each reads the counts
    on the host): one graph, agreeing with eager (the loop) by the rule against the layer's
    float64 copy."""
    experts.set_segments_impl("loop")
    torch.manual_seed(0)
    moe = MoE(H, F, E, top_k=2, capacity_factor=None, expert="swiglu")
    moe.aux_loss_scale = 0.5  # a constant: no context lookup to trace (as test_moe_compile)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(2))
    want, exact = moe(x), exact_copy(moe)(x.double())
    got = torch.compile(moe, backend="eager", fullgraph=True)(x)
    agree(got, want, exact, "compiled output", length=LENGTH)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equals_loop_on_cuda(impl, dtype):
    """On a GPU ("grouped" is torch._grouped_mm in bf16; fp32 TF32 off by default), by the rule
    against the loop in float64."""
    for counts in COUNTS.values():
        _check(impl, counts, True, False, "silu", dtype, device="cuda")
        _check(impl, counts, False, True, "gelu", dtype, device="cuda")
