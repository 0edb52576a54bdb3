"""MoE experts in fp8 (issue 47, point 2; ``fastpar.moe.fp8_experts``): a SwiGLU MoE layer whose
routed experts run in fp8, at EP 1 / 2 and expert TP 1 / 2, dropless and with capacity, against
one device's fp8 layer holding every expert and every EP rank's batch (the batches of the EP
ranks concatenated: the same tokens reach each expert, in the same order), for each recipe:
outputs, the input gradient and every parameter gradient on every rank (an expert's against its
slice; the router's summed over the data-parallel ranks, each of which saw its own tokens). A
planted fault (the amax under expert TP not reduced over the TP group) fails the comparison;
shapes the recipe cannot scale, the sequence layout and overlap chunks are refused naming the
module; experts that get no tokens work, as does an EP rank none of whose experts gets any.

How they are compared: every expert's fp8 operands are the same on both sides (per-expert
scales, reduced over expert TP), so what may differ is the fp32 summation order (the expert-TP
all-reduce of the second GEMM's partial sums, and of the input gradient). Each quantity is
judged by docs/tolerances.md's rule with the one-device fp8 run itself as the exact value (no
float64 run of a chain of fp8 roundings exists): the rule's floor alone, one rounding plus a
sum of ``n`` terms, stricter than the rule. At EP 1 and expert TP 1 (the same code on the same
shapes) every quantity is asserted bit for bit. Elsewhere, measured on this CPU (torch 2.13,
oneDNN on): at EP 2 the output and dx came out bit for bit (tensorwise, rowwise, blockwise), the
expert gradients not (rowwise's w2 did); at expert TP 2 the expert gradients did (tensorwise,
rowwise; blockwise also the output), the output and dx after the TP all-reduce not; the router's
gradient summed over the DP ranks never. Only the rule is asserted there."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh

from fastpar.moe import MoE, fp8_experts
from fastpar.nn import use_fp8
from fastpar.nn.marks import param_layout
from fastpar.ops import fp8 as op
from fastpar.ops.fp8_linear import Fp8Use, fp8_linear
from fastpar.testing import run_ranks
from fastpar.tolerance import compare

E, K, B, S = 4, 2, 2, 8
ROUTED = ("w1", "b1", "w2", "b2")


def _dims(recipe: str) -> tuple[int, int]:
    """(hidden, ffn): blockwise needs 128 per rank of each of gate and up at expert TP 2."""
    return (128, 256) if recipe == "blockwise" else (32, 64)


def _layer(mesh, recipe: str, expert_tp: bool, capacity) -> MoE:
    h, f = _dims(recipe)
    torch.manual_seed(0)
    moe = MoE(
        h,
        f,
        E,
        K,
        expert="swiglu",
        capacity_factor=capacity,
        min_capacity=None,
        aux_loss_coef=0.0,
        mesh=mesh,
        expert_tp=expert_tp,
    )
    assert use_fp8(moe, recipe) == [""]
    return moe


def _batch(rank: int, hidden: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(B, S, hidden, generator=g), torch.randn(B, S, hidden, generator=g)


def _grads(moe: MoE, x, g):
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}


def _local(full: torch.Tensor, p, mesh, name: str, moe: MoE) -> torch.Tensor:
    """This rank's part of the one-device tensor ``full`` laid out like parameter ``p``."""
    if name in ROUTED:
        full = full[mesh.ep_rank * moe.num_local : (mesh.ep_rank + 1) * moe.num_local]
    layout = param_layout(p)
    if layout is not None and layout.kind == "sharded":
        halves = full.chunk(layout.fused, layout.dim)
        parts = [h.chunk(mesh.tp_size, layout.dim)[mesh.tp_rank] for h in halves]
        full = torch.cat(parts, layout.dim)
    return full


def _starve(moe: MoE) -> None:
    """Experts 2 and 3 (EP rank 1's at EP 2) never chosen, for inputs of positive entries."""
    with torch.no_grad():
        moe.router.weight[2:] = -5.0


def _agrees(recipe, ep: int, etp: int, capacity, fault: bool, starve=False) -> tuple[list, list]:
    """(disagreements, the quantities equal bit for bit) on this rank. ``starve``: the last two
    experts get no tokens."""
    if fault:
        op.shared_amax = lambda amax, group: amax
    mesh = make_mesh(tp=etp, ep=ep)
    hidden = _dims(recipe)[0]
    moe = _layer(mesh, recipe, etp > 1, capacity)
    ref = _layer(None, recipe, False, capacity)
    batches = [_batch(r, hidden) for r in range(mesh.dp_size)]
    if starve:
        _starve(moe), _starve(ref)
        batches = [(x.abs(), g) for x, g in batches]
    x_all, g_all = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    y_ref, dx_ref, grads_ref = _grads(ref, x_all, g_all)
    mine = slice(mesh.dp_rank * B, (mesh.dp_rank + 1) * B)
    y, dx, grads = _grads(moe, *batches[mesh.dp_rank])
    n = max(B * S * mesh.dp_size * K, hidden, _dims(recipe)[1])
    pairs = {"output": (y, y_ref[mine]), "dx": (dx, dx_ref[mine])}
    for name, p in moe.named_parameters():
        got = grads[name]
        if name not in ROUTED and mesh.dp_size > 1:  # each DP rank's own tokens: summed
            dist.all_reduce(got, group=mesh.dp_group)
        pairs[name] = (got, _local(grads_ref[name], p, mesh, name, moe))
    wrong, bitwise = [], []
    for name, (got, want) in pairs.items():
        assert got.shape == want.shape, name
        c = compare(got, want, want.double(), length=n, what=name)
        if not c.ok:
            wrong.append(f"rank {dist.get_rank()}: {c}")
        elif torch.equal(got, want):
            bitwise.append(name)
    return wrong, bitwise


CASES = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("capacity", [None, 4.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("ep,etp", CASES, ids=[f"ep{e}-etp{t}" for e, t in CASES])
@pytest.mark.parametrize("recipe", op.RECIPES)
def test_fp8_experts_equal_one_device(recipe, ep, etp, capacity):
    results = run_ranks(_agrees, ep * etp, recipe, ep, etp, capacity, False)
    assert [w for w, _ in results] == [[]] * (ep * etp)
    if ep == etp == 1:
        assert sorted(results[0][1]) == ["dx", "output", "router.weight", "w1", "w2"]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_an_amax_left_unreduced_over_expert_tp_is_caught(name):
    """Tensorwise: every scale of the split operands; rowwise: the rows the split cuts (the
    second matrix's input and weight, and the first one's output gradient, along F). Scales not
    rounded to powers of two: rounded (rowwise's default, tensorwise's option), a half row's
    amax gives the whole row's scale unless the other half's max exceeds it by 2x or more, which
    these random weights never do (checked: not caught then)."""
    recipe = op.Fp8Recipe(name, pow2=False)
    results = run_ranks(_agrees, 2, recipe, 1, 2, None, True)
    assert any(w for w, _ in results), "the planted fault went unnoticed"


def test_fp8_experts_stay_near_the_high_precision_ones():
    """The quantization's error, not a wrong computation: within 10 % of the unquantized layer."""
    for recipe in op.RECIPES:
        moe = _layer(None, recipe, False, None)
        x, g = _batch(0, moe.hidden_size)
        y8, dx8, grads8 = _grads(moe, x, g)
        use_fp8(moe, None)
        y, dx, grads = _grads(moe, x, g)
        for name, a, b in [("y", y8, y), ("dx", dx8, dx), ("w1", grads8["w1"], grads["w1"])]:
            assert (a - b).norm() < 0.1 * b.norm(), f"{recipe} {name}"


def test_an_expert_without_tokens_is_skipped():
    """Per expert through ``fp8_linear`` alike; the empty expert's weights get zero gradients."""
    torch.manual_seed(1)
    w1, w2 = torch.randn(3, 32, 128) * 0.1, torch.randn(3, 64, 32) * 0.1
    x = torch.randn(20, 32)
    counts = [7, 0, 13]
    use = Fp8Use(op.recipe_of("tensorwise"))
    f = fp8_experts.plan(use)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    y = fp8_experts.segments(leaves[0], counts, leaves[1], None, leaves[2], None, True, "silu", f)
    y.square().sum().backward()
    assert y.shape == (20, 32) and torch.equal(leaves[1].grad[1], torch.zeros(32, 128))
    assert torch.equal(leaves[2].grad[1], torch.zeros(64, 32))
    for e, rows in ((0, slice(0, 7)), (2, slice(7, 20))):
        h = fp8_linear(x[rows], w1[e].t(), use)
        gate, up = h.chunk(2, -1)
        want = fp8_linear(torch.nn.functional.silu(gate) * up, w2[e].t(), use)
        assert torch.equal(y[rows].detach(), want), e
    batched = fp8_experts.batched(x.new_zeros(3, 0, 32), w1, None, w2, None, True, "silu", f)
    assert batched.shape == (3, 0, 32)


def _starved_twice(recipe: str, ep: int, etp: int) -> list:
    wrong = []
    for _ in range(2):  # a second step: the all-to-alls still pair up
        wrong += _agrees(recipe, ep, etp, None, False, starve=True)[0]
    return wrong


@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (2, 2)], ids=["ep1", "ep2", "ep2-etp2"])
def test_experts_without_tokens_and_a_rank_without_any(ep, etp):
    """Experts 2 and 3 get no tokens: at EP 2 all of rank 1's (once, this hung: its experts'
    output left the graph, so its dispatch skipped the backward all-to-all its peer ran).
    Equal to one device still, their gradients zeros."""
    assert run_ranks(_starved_twice, ep * etp, "tensorwise", ep, etp) == [[]] * (ep * etp)
    moe = _layer(None, "tensorwise", False, None)
    _starve(moe)
    x, g = _batch(0, moe.hidden_size)
    y, dx, grads = _grads(moe, x.abs(), g)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert moe.stats["counts"][2:].tolist() == [0, 0], moe.stats["counts"]
    assert torch.equal(grads["w1"][2:], torch.zeros_like(grads["w1"][2:]))


def _refusal(hidden: int, ffn: int, recipe: str, tp: int, **kw) -> str:
    mesh = make_mesh(tp=tp)
    moe = MoE(hidden, ffn, E, K, expert="swiglu", mesh=mesh, **kw)
    model = torch.nn.ModuleDict({"mlp": moe})
    try:
        use_fp8(model, recipe)
    except ValueError as exc:
        return str(exc)
    return "taken"


@pytest.mark.parametrize(
    "hidden,ffn,recipe,says",
    [
        (40, 64, "tensorwise", r"hidden_size 40, not a multiple of 16"),
        (128, 128, "blockwise", r"ffn_hidden_size per rank 64, not a multiple of 128"),
    ],
)
def test_a_width_the_recipe_cannot_scale_is_refused_naming_the_module(hidden, ffn, recipe, says):
    got = run_ranks(_refusal, 2, hidden, ffn, recipe, 2, expert_tp=True)[0]
    assert f"fp8 {recipe}: mlp (MoE experts" in got and says in got, got


def test_overlap_chunks_are_refused():
    """The overlapped all-to-all runs each expert's tokens in chunks: per-chunk scales (measured
    before the refusal: tensorwise at EP 2, dropless, 2 chunks, off by 0.01-0.4)."""
    got = run_ranks(_refusal, 2, 32, 64, "tensorwise", 1, overlap_chunks=2)[0]
    assert got.startswith("fp8: mlp runs its experts in 2 chunks"), got


def test_the_sequence_layout_is_refused():
    kw = dict(sequence_parallel=True, capacity_factor=None)
    got = run_ranks(_refusal, 2, 32, 64, "tensorwise", 2, **kw)[0]
    assert got.startswith("fp8: mlp routes each TP rank's share of the sequence"), got
