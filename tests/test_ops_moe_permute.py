"""MoE permute / unpermute, CPU tier: the torch reference (through the op) against a hand-written
Python loop over (token, choice) pairs with dicts and lists, on adversarial routings (in
float64 both); the hand-written backward against ``torch.autograd.gradcheck`` in fp64 and, in
fp32, against autograd of the reference by the rule of ``fastpar.tolerance`` (float64 the exact
math); validation errors. Equality is bit for bit only where rows are moved, not summed.
"""

from __future__ import annotations

import pytest
import torch
from _parity import agree

from fastpar.ops import backend
from fastpar.ops.moe_permute import PermuteInfo, moe_permute, moe_unpermute
from fastpar.reference import moe_permute as ref


def loop_routing(expert_ids: list[list[int]], num_experts: int, capacity, order=None) -> dict:
    """The obviously correct oracle: walk the pairs one by one in processing order."""
    t = len(expert_ids)
    k = len(expert_ids[0]) if t else 0
    pairs = [(tok, j) for j in range(k) for tok in range(t)]  # choice-major: p = j·T + t
    if order is not None:
        pairs = [pairs[p] for p in order]
    counts = {e: 0 for e in range(num_experts)}
    slots = [[-1] * k for _ in range(t)]
    position = {}
    for tok, j in pairs:
        e = expert_ids[tok][j]
        position[(tok, j)] = counts[e]
        counts[e] += 1
    if capacity is None:
        start, offsets = 0, [0]
        starts = {}
        for e in range(num_experts):
            starts[e] = start
            start += counts[e]
            offsets.append(start)
        for (tok, j), pos in position.items():
            slots[tok][j] = starts[expert_ids[tok][j]] + pos
        kept = dict(counts)
    else:
        for (tok, j), pos in position.items():
            if pos < capacity:
                slots[tok][j] = expert_ids[tok][j] * capacity + pos
        kept = {e: min(c, capacity) for e, c in counts.items()}
        offsets = [e * capacity for e in range(num_experts + 1)]
    return {
        "slots": slots,
        "counts": [counts[e] for e in range(num_experts)],
        "kept": [kept[e] for e in range(num_experts)],
        "offsets": offsets,
        "dropped": sum(counts.values()) - sum(kept.values()),
    }


def loop_permute(x: list[list[float]], slots: list[list[int]], rows: int) -> list[list[float]]:
    h = len(x[0]) if x else 0
    out = [[0.0] * h for _ in range(rows)]
    for tok, row in enumerate(slots):
        for s in row:
            if s >= 0:
                out[s] = list(x[tok])
    return out


def loop_unpermute(src: list[list[float]], slots, probs, h: int) -> list[list[float]]:
    out = []
    for tok, row in enumerate(slots):
        acc = [0.0] * h
        for j, s in enumerate(row):
            if s >= 0:
                acc = [a + probs[tok][j] * v for a, v in zip(acc, src[s], strict=True)]
        out.append(acc)
    return out


def _routing(kind: str, t: int, k: int, e: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "one_expert":  # everything to the last expert: far more than any capacity
        return torch.full((t, k), e - 1, dtype=torch.int64)
    if kind == "empty_experts":  # only experts 1 and 3 used
        return torch.tensor([1, 3])[torch.randint(0, 2, (t, k), generator=gen)]
    if kind == "duplicate_choice":  # both choices of a token to the same expert
        ids = torch.randint(0, e, (t, 1), generator=gen)
        return ids.expand(t, k).contiguous()
    return torch.randint(0, e, (t, k), generator=gen)


CASES = [  # (kind, T, k, E, capacity)
    ("random", 1, 1, 4, 1),
    ("random", 1, 2, 4, None),
    ("random", 13, 2, 4, 3),
    ("random", 13, 1, 4, 5),
    ("random", 17, 2, 5, None),
    ("one_expert", 16, 2, 4, 3),  # 32 routed, 3 fit
    ("one_expert", 9, 1, 3, None),
    ("empty_experts", 11, 2, 6, 4),
    ("empty_experts", 11, 2, 6, None),
    ("duplicate_choice", 10, 2, 3, 4),
    ("random", 8, 2, 4, 0),  # capacity 0: everything dropped
    ("random", 40, 2, 70, 2),  # E > 64
]


def _check_against_loop(kind, t, k, e, capacity, h=123, order=None, seed=0):
    ids = _routing(kind, t, k, e, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, h, generator=gen, dtype=torch.float64)
    out, info = moe_permute(x, ids, e, capacity, order=order)
    want = loop_routing(ids.tolist(), e, capacity, None if order is None else order.tolist())
    assert isinstance(info, PermuteInfo)
    assert info.slots.dtype == torch.int64 and info.slots.shape == (t, k)
    assert info.slots.tolist() == want["slots"]
    assert info.counts.tolist() == want["counts"]
    assert info.kept_counts.tolist() == want["kept"]
    assert info.offsets.tolist() == want["offsets"]
    assert info.num_dropped.dim() == 0 and int(info.num_dropped) == want["dropped"]
    assert info.mode == ("dropless" if capacity is None else "capacity")
    rows = t * k if capacity is None else e * capacity
    assert out.shape == ((rows, h) if capacity is None else (e, capacity, h))
    assert out.reshape(rows, h).tolist() == loop_permute(x.tolist(), want["slots"], rows)
    src = torch.randn(rows, 7, generator=gen, dtype=torch.float64)
    probs = torch.rand(t, k, generator=gen, dtype=torch.float64)
    got = moe_unpermute(src.view(*out.shape[:-1], 7), probs, info)
    expect = loop_unpermute(src.tolist(), want["slots"], probs.tolist(), 7)
    torch.testing.assert_close(got, torch.tensor(expect, dtype=torch.float64).view(t, 7))


@pytest.mark.parametrize(("kind", "t", "k", "e", "capacity"), CASES)
def test_reference_matches_python_loop(kind, t, k, e, capacity):
    _check_against_loop(kind, t, k, e, capacity)


@pytest.mark.parametrize("capacity", [3, None])
def test_order_argument(capacity):
    t, k, e = 12, 2, 3
    order = torch.randperm(t * k, generator=torch.Generator().manual_seed(4))
    _check_against_loop("random", t, k, e, capacity, h=5, order=order, seed=7)
    ids = _routing("random", t, k, e, 7)
    natural = moe_permute(torch.zeros(t, 1), ids, e, capacity, order=torch.arange(t * k))[1]
    assert natural.slots.equal(moe_permute(torch.zeros(t, 1), ids, e, capacity)[1].slots)


def test_first_choices_win_over_second_choices():
    """Position policy: a later token's first choice beats an earlier token's second choice."""
    ids = torch.tensor([[1, 0], [0, 1]])  # token 0 picks 0 second; token 1 picks 0 first
    _, info = moe_permute(torch.randn(2, 4), ids, 2, capacity=1)
    assert info.slots.tolist() == [[1, -1], [0, -1]]


def test_dropless_round_trip_returns_x():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 123, generator=gen)
    ids = torch.randint(0, 8, (37, 1), generator=gen)
    out, info = moe_permute(x, ids, 8, None)
    assert int(info.num_dropped) == 0 and out.shape == (37, 123)
    back = moe_unpermute(out, torch.ones(37, 1), info)
    assert back.equal(x)  # exact: k = 1, each token's one row times 1.0, added to 0
    # expert-major: rows of expert e lie between offsets[e] and offsets[e+1]
    for ex in range(8):
        lo, hi = info.offsets[ex].item(), info.offsets[ex + 1].item()
        assert out[lo:hi].equal(x[ids[:, 0] == ex])


def test_dropped_choices_contribute_nothing_to_output_or_grads():
    ids = torch.zeros(6, 2, dtype=torch.int64)
    x = torch.randn(6, 4, requires_grad=True)
    out, info = moe_permute(x, ids, 2, capacity=2)
    probs = torch.rand(6, 2, requires_grad=True)
    eo = (out * 3).detach().requires_grad_()
    y = moe_unpermute(eo, probs, info)
    dropped = info.slots < 0
    assert dropped.sum() == 10 and int(info.num_dropped) == 10
    assert (y[dropped.all(1)] == 0).all()
    y.sum().backward()
    assert (probs.grad[dropped] == 0).all()
    out.sum().backward()
    assert (x.grad[dropped.all(1)] == 0).all()
    # exact: the gradient of a copy is the ones it was fed, one kept row per token here
    assert x.grad[0].equal(torch.ones(4)) and x.grad[1].equal(torch.ones(4))


@pytest.mark.parametrize(
    ("kind", "k", "capacity"),
    [("random", 2, 3), ("one_expert", 2, 2), ("random", 1, None), ("random", 2, None)],
)
def test_gradcheck_fp64(kind, k, capacity):
    t, e, h = 7, 3, 5
    ids = _routing(kind, t, k, e, 11)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(t, h, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(t, k, generator=gen, dtype=torch.float64, requires_grad=True)
    _, info = moe_permute(x.detach(), ids, e, capacity)
    src = torch.randn((*info.permuted_shape[:-1], 6), generator=gen, dtype=torch.float64)
    src.requires_grad_()
    assert torch.autograd.gradcheck(lambda a: moe_permute(a, ids, e, capacity)[0], (x,))
    assert torch.autograd.gradcheck(lambda s, p: moe_unpermute(s, p, info), (src, probs))
    # permute then unpermute, end to end
    assert torch.autograd.gradcheck(
        lambda a, p: moe_unpermute(moe_permute(a, ids, e, capacity)[0] * 2, p, info), (x, probs)
    )
    # the row movers of the reference are differentiable torch ops too
    assert torch.autograd.gradcheck(
        lambda s, p: ref.unpermute(s.view(-1, 6), info.slots, p), (src, probs)
    )


def test_hand_written_backward_matches_autograd_of_reference():
    """fp32: the hand-written gradients against autograd of the reference in fp32 and in float64
    (the exact math), by the rule: d src is one product per element, d probs a dot product of
    the hidden size."""
    t, k, e, h = 9, 2, 4, 10
    ids = _routing("random", t, k, e, 5)
    gen = torch.Generator().manual_seed(6)
    _, info = moe_permute(torch.zeros(t, 1), ids, e, 3)
    src = torch.randn(info.num_rows, h, generator=gen, requires_grad=True)
    probs = torch.rand(t, k, generator=gen, requires_grad=True)
    g = torch.randn(t, h, generator=gen)
    ref.unpermute(src, info.slots, probs).backward(g)
    src64 = src.detach().double().requires_grad_()
    probs64 = probs.detach().double().requires_grad_()
    ref.unpermute(src64, info.slots, probs64).backward(g.double())
    d_src, d_probs = ref.unpermute_backward(
        g, src.detach(), info.slots, probs.detach(), info.kept_counts, 3
    )
    agree(d_src, src.grad, src64.grad, "d src", length=1)
    agree(d_probs, probs.grad, probs64.grad, "d probs", length=h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(10, 16, generator=gen).to(dtype)
    ids = torch.randint(0, 3, (10, 2), generator=gen)
    out, info = moe_permute(x, ids, 3, 5)
    assert out.dtype == dtype
    probs = torch.rand(10, 2, generator=gen)  # fp32 probs with low-precision rows
    y = moe_unpermute(out, probs, info)
    assert y.dtype == dtype
    want = moe_unpermute(out.double(), probs.double(), info)
    # a statement of error against float64, not a parity check: two products summed in fp32,
    # then one rounding to the row dtype (2^-9 relative for bf16, 2^-12 for fp16)
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)


def test_cpu_tensors_select_the_reference():
    assert backend.select("moe_permute", "cpu") == "reference"
    assert backend.select("moe_unpermute", "cpu") == "reference"
    assert "moe_permute" in backend.registered_ops()


def test_validation_errors():
    x = torch.randn(4, 3)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="expert_ids"):
        moe_permute(x, ids.float(), 2, 2)
    with pytest.raises(ValueError, match="expert_ids"):
        moe_permute(x, ids[:3], 2, 2)
    with pytest.raises(ValueError, match="capacity"):
        moe_permute(x, ids, 2, -1)
    with pytest.raises(ValueError, match="order"):
        moe_permute(x, ids, 2, 2, order=torch.arange(7))
    with pytest.raises(RuntimeError, match="outside"):
        moe_permute(x, ids + 5, 2, 2)
    with pytest.raises(RuntimeError, match="not a permutation"):
        moe_permute(x, ids, 2, 2, order=torch.zeros(8, dtype=torch.int64))
    out, info = moe_permute(x, ids, 2, 2)
    with pytest.raises(ValueError, match="layout"):
        moe_unpermute(out.reshape(4, 3), torch.ones(4, 2), info)
    with pytest.raises(ValueError, match="probs"):
        moe_unpermute(out, torch.ones(4, 1), info)
