"""The fp8 linear layer (issue 47, points 1, 2 and 8): ``fastpar.ops.fp8_linear.Fp8LinearFunction``
against its one-device reference (``fastpar.reference.fp8_linear``), for every recipe; the
column- and row-parallel layers in fp8 at TP 1 and 2, with and without sequence parallelism,
against one device's fp8 layer (output and every gradient on every rank); a planted fault (the
amax not reduced over TP) that the comparison catches; the refusals.

How they are compared: the same fp8 operands (bytes and scales) on both sides, so what may
differ is only the fp32 summation order of the GEMMs (torch._scaled_mm's oneDNN against the
emulation; a TP all-reduce of partial products). Each quantity is judged by
docs/tolerances.md's rule against the same fp8 operands multiplied in float64
(``linear_reference(exact=True)``); where both sides run the same kernel on the same shapes
the test asks for equality bit for bit, and says so.
"""

from __future__ import annotations

import pytest
import torch

from fastpar.ops import fp8 as op
from fastpar.ops.fp8_linear import fp8_linear
from fastpar.reference.fp8_linear import linear_reference
from fastpar.tolerance import assert_agree

# tokens 48 (not a multiple of 128: padded for blockwise), in 256, out 384
M, K, N = 48, 256, 384


def _t(shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 2.0).to(dtype)


def _run(x, w, g, recipe):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, recipe)
    y.backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", op.RECIPES)
def test_function_agrees_with_its_reference(recipe, dtype):
    """Output, input and weight gradients against the reference: bit for bit with oneDNN off
    (both sides then run the same fp32 GEMM; blockwise always: both emulate), within the rule
    of docs/tolerances.md with it on (another summation order in torch._scaled_mm)."""
    rec = op.Fp8Recipe(recipe)
    x, w, g = _t((M, K), 1, dtype), _t((N, K), 2, dtype) * 0.05, _t((M, N), 3, dtype)
    single = linear_reference(x, w, g, rec)
    exact = linear_reference(x, w, g, rec, exact=True)
    full = (x.double() @ w.double().t(), g.double() @ w.double(), g.double().t() @ x.double())
    for name, e, f in zip(("y", "dx", "dw"), exact, full, strict=True):  # the quantization's
        assert (e - f).norm() < 0.1 * f.norm(), f"{recipe} {name}: far from the unquantized"
    with torch.backends.mkldnn.flags(enabled=False):
        got = _run(x, w, g, rec)
    for name, a, b in zip(("y", "dx", "dw"), got, single, strict=True):
        assert a.dtype == dtype, name
        assert torch.equal(a, b), f"{recipe} {name}: not bit for bit with oneDNN off"
    got = _run(x, w, g, rec)
    lengths = (K, N, M)
    for name, a, b, e, n in zip(("y", "dx", "dw"), got, single, exact, lengths, strict=True):
        assert_agree(a, b, e, length=n, what=f"{recipe} {name}")


def test_the_weight_stays_the_leaf_and_fp8_is_not_kept():
    """The parameter's gradient is in its own dtype; nothing fp8 is held by the module."""
    w = torch.nn.Parameter(_t((N, K), 2) * 0.05)
    y = fp8_linear(_t((2, 24, K), 1), w, "rowwise")
    assert y.shape == (2, 24, N) and y.dtype == torch.float32
    y.sum().backward()
    assert w.grad.dtype == torch.float32 and w.grad.shape == (N, K)


# -- the tensor-parallel layers against one device ------------------------------------------
S, B, H = 32, 3, 256  # [sequence, batch, features]: 96 tokens (blockwise pads them to 128)


def _layer_case(kind: str, sp: bool, tp: int, rank: int, recipe: str):
    """(dense layer, its fp8 TP layer, input on this rank, full input, output gradient on this
    rank, full output gradient). The largest values sit in rank 1's share of every split operand,
    so a scale left unreduced differs on rank 0."""
    from _mesh import make_mesh

    from fastpar.nn import ColumnParallelLinear, RowParallelLinear, use_fp8

    mesh = make_mesh(tp=tp)
    torch.manual_seed(0)
    dense = torch.nn.Linear(H, H)
    x, g, half = _t((S, B, H), 11), _t((S, B, H), 12), slice(0, H // 2)
    # rank 0's share of a group tiny: rowwise scales are powers of two, which an unreduced amax
    # changes without changing the rounding, but for values that fall below e4m3's normals
    with torch.no_grad():
        if kind != "row":
            dense.weight[H - 3, 5] = 1.5  # an output row of rank 1
            dense.weight[half, 5] *= 1e-4
        else:
            dense.weight[7, H - 5] = 1.5  # an input column of rank 1
            dense.weight[7, half] *= 1e-4
    x[2, 1, H - 9] = 40.0  # rank 1's input column (row-parallel) and sequence chunk (not SP)
    x[2, 1, half] *= 1e-4
    g[3, 0, H - 2] = 50.0  # rank 1's output column (column-parallel)
    g[3, 0, half] *= 1e-4
    cls = RowParallelLinear if kind == "row" else ColumnParallelLinear
    fused = dict(fused=2) if kind == "fused" else {}
    layer = cls.from_dense(dense, group=mesh.tp_group, sequence_parallel=sp, **fused)
    use_fp8(layer, recipe)
    x_in, g_in, cols = x, g, slice(rank * H // tp, (rank + 1) * H // tp)
    if kind == "fused":  # this rank's share of each of the two stacked blocks
        block, share = H // 2, H // 2 // tp
        cols = torch.cat(
            [torch.arange(b * block + rank * share, b * block + (rank + 1) * share) for b in (0, 1)]
        )
    if kind == "row":
        x_in = x[..., cols]
    else:
        g_in = g[..., cols]
    if sp:  # the column layer's input and the row layer's output: this rank's sequence chunk
        chunk = slice(rank * S // tp, (rank + 1) * S // tp)
        x_in = x_in if kind == "row" else x_in[chunk]
        g_in = g_in[chunk] if kind == "row" else g_in
    return dense, layer, x_in.contiguous(), x, g_in.contiguous(), g, cols


def _tp_layer_agrees(kind: str, sp: bool, tp: int, recipe: str, fault: bool) -> list[str]:
    """This rank's output and every gradient of the fp8 layer against its piece of one
    device's fp8 run (``linear_reference``, the rule of docs/tolerances.md). Returns each
    disagreement. ``fault``: the amax max-reduction over TP planted out."""
    import torch.distributed as dist

    from fastpar.ops import fp8 as ops_fp8
    from fastpar.tolerance import compare

    if fault:
        ops_fp8.shared_amax = lambda amax, group: amax
    rank = dist.get_rank()
    dense, layer, x_in, x, g_in, g, cols = _layer_case(kind, sp, tp, rank, recipe)
    x_in.requires_grad_()
    y = layer(x_in)
    y.backward(g_in)
    rec = op.Fp8Recipe(recipe)
    w, b = dense.weight.detach(), dense.bias.detach()
    flat = lambda t: t.reshape(-1, H)  # noqa: E731
    single = linear_reference(flat(x), w, flat(g), rec)
    exact = linear_reference(flat(x).double(), w.double(), flat(g).double(), rec, exact=True)
    full = lambda t: t.reshape(S, B, H)  # noqa: E731
    chunk = slice(rank * S // tp, (rank + 1) * S // tp) if sp else slice(None)
    bias_g = (g.sum(dim=(0, 1)), g.double().sum(dim=(0, 1)))
    if kind != "row":  # out: this rank's columns; dx: whole (SP: its chunk); dW: its rows
        pieces = {
            "y": (y, lambda r, e: full(r)[..., cols] + (b.double() if e else b)[cols], H),
            "dx": (x_in.grad, lambda r, e: full(r)[chunk], H),
            "dW": (layer.weight.grad, lambda r, e: r[cols], S * B),
            "db": (layer.bias.grad, lambda r, e: bias_g[e][cols], S * B),
        }
    else:  # out: whole (SP: its chunk); dx: this rank's columns; dW: its columns
        pieces = {
            "y": (y, lambda r, e: full(r)[chunk] + (b.double() if e else b), H),
            "dx": (x_in.grad, lambda r, e: full(r)[..., cols], H),
            "dW": (layer.weight.grad, lambda r, e: r[:, cols], S * B),
            "db": (layer.bias.grad, lambda r, e: bias_g[e], S * B),
        }
    which = {"y": 0, "dx": 1, "dW": 2, "db": 0}
    wrong = []
    for name, (got, piece, n) in pieces.items():
        i = which[name]
        c = compare(got, piece(single[i], False), piece(exact[i], True), length=n, what=name)
        if not c.ok:
            wrong.append(f"rank {rank}: {c}")
    return wrong


LAYOUTS = [(1, False), (2, False), (2, True)]


@pytest.mark.parametrize("tp,sp", LAYOUTS, ids=["tp1", "tp2", "tp2-sp"])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe", op.RECIPES)
def test_tp_layer_equals_one_device(recipe, kind, tp, sp):
    from fastpar.testing import run_ranks

    assert run_ranks(_tp_layer_agrees, tp, kind, sp, tp, recipe, False) == [[]] * tp


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_fused_column_layer_equals_one_device(recipe):
    """gate|up (fused=2) at TP 2: each rank holds its share of both blocks; the scales are one
    device's whole weight's and gradient's all the same (a max over any order)."""
    from fastpar.testing import run_ranks

    assert run_ranks(_tp_layer_agrees, 2, "fused", True, 2, recipe, False) == [[], []]


def _fused_blockwise_refusal() -> str:
    from _mesh import make_mesh

    from fastpar.nn import ColumnParallelLinear, use_fp8

    layer = ColumnParallelLinear(H, H, fused=2, mesh=make_mesh(tp=2))
    try:
        use_fp8(torch.nn.ModuleDict({"gate_up": layer}), "blockwise")
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_fused_block_share_that_cuts_a_128_block_is_refused():
    """Blockwise at TP 2 with blocks of 128 rows: 64 of each a rank would cut one device's
    128 x 128 blocks (its scales could not be one device's): refused."""
    from fastpar.testing import run_ranks

    text = run_ranks(_fused_blockwise_refusal, 2)[0]
    assert (
        "gate_up (ColumnParallelLinear 256 -> 256, tp 2) has each fused block's rows per " in text
    )
    assert "rank 64, not a multiple of 128" in text


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_amax_left_unreduced_over_tp_is_caught(recipe, kind):
    """The same comparison with the max-reduction of the amax over TP planted out: rank 0 then
    scales with its own slice's amax and the comparison fails (blockwise has nothing to reduce:
    a split never cuts a block). Rowwise scales are powers of two: a wrong one moves only the
    values it pushes across e4m3's smallest normal, which ``_layer_case`` plants."""
    from fastpar.testing import run_ranks

    results = run_ranks(_tp_layer_agrees, 2, kind, False, 2, recipe, True)
    assert results[0], f"{recipe} {kind}: the planted fault went unnoticed"
    assert any("DISAGREE" in line for line in results[0])


# -- the filter and the refusals ------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, out: int = 256, width: int = 256):
        from fastpar.nn import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.qkv = ColumnParallelLinear(width, out, bias=False)
        self.o = RowParallelLinear(out, width, bias=False)
        self.gate = ColumnParallelLinear(width, 16, bias=False)  # an HF MoE router's name
        self.lm_head = ColumnParallelLinear(width, 48, bias=False)


def _one_rank(fn, *args):
    from fastpar.testing import run_ranks

    return run_ranks(fn, 1, *args)[0]


def _chosen(exclude):
    from fastpar.nn import use_fp8

    block = _Block()
    names = use_fp8(block, "tensorwise", exclude=exclude)
    return names, [n for n, m in block.named_children() if m.fp8 is not None]


def test_the_default_filter_keeps_heads_and_routers_in_high_precision():
    assert _one_rank(_chosen, None) == (["qkv", "o"], ["qkv", "o"])
    assert _one_rank(_chosen, ("o",)) == (["qkv", "gate", "lm_head"], ["qkv", "gate", "lm_head"])


def _refusal(recipe: str, out: int, width: int, device: str = "cpu") -> str:
    from fastpar.nn import use_fp8

    block = _Block(out, width).to(device)
    try:
        use_fp8(block, recipe)
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    "recipe,out,width,says",
    [
        ("tensorwise", 200, 256, "qkv (ColumnParallelLinear 256 -> 200, tp 1) has output rows"),
        ("rowwise", 256, 200, "qkv (ColumnParallelLinear 200 -> 256, tp 1) has in_features 200"),
        ("blockwise", 192, 256, "qkv (ColumnParallelLinear 256 -> 192, tp 1) has output rows"),
        ("blockwise", 256, 256, ""),
    ],
)
def test_a_shape_the_recipe_cannot_scale_is_refused_naming_the_module(recipe, out, width, says):
    text = _one_rank(_refusal, recipe, out, width)
    assert says in text and "\n" not in text
    if says:
        assert "--fp8-exclude 'qkv'" in text


def test_a_device_without_fp8_gemms_is_refused():
    text = _one_rank(_refusal, "tensorwise", 256, 256, "meta")
    assert text.startswith("fp8: qkv is on meta, which has no fp8 GEMM") and "\n" not in text


def test_the_filter_patterns():
    from fastpar.nn.fp8_apply import parse_patterns, selected

    assert parse_patterns(None) is None and parse_patterns("default") is None
    assert parse_patterns("") == () and parse_patterns(" *.o , lm_head") == ("*.o", "lm_head")
    assert selected("1.mlp.gate_up") and selected("1.mlp.gate_proj")
    assert not any(selected(n) for n in ("lm_head", "1.mlp.gate", "0.embed.proj", "1.router.w"))
    assert selected("lm_head", exclude=()) and not selected("1.attn.o", exclude=("*.o",))
    assert not selected("1.attn.qkv", include=("*.mlp.*",))
