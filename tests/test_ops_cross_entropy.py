"""CPU tier: vocab-parallel cross-entropy on 1, 2 and 4 gloo ranks against F.cross_entropy.

The references are torch on the full (gathered) logits, from the very values each rank holds:
``F.cross_entropy(full, target, label_smoothing=α) + z·logsumexp(full)²``, backward on the full
logits, the gradient padded and sliced into each rank's shard — once in fp32 (the
single-process run; its gradient stored in the logits' dtype, as the op stores it) and once in
float64 (the exact math; bf16 / fp16 inputs are exact there). The op's loss and gradient must
agree by the rule of ``fastpar.tolerance`` (``_parity.agree``: error against float64 at most
4 x the fp32 run's own + a floor), not within a fixed tolerance. Every case of one world size
runs in one ``run_ranks`` call.

Ranks return their tensors as ``pickle.dumps`` bytes: a tensor sent back as-is travels through
torch's shared-memory reducer, whose file descriptor the parent may fetch after the rank has
already exited (a flaky "exited without a result").
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ce import LossCase, assert_loss_agrees, case_loss, ignore_and_upstream, loss_options
from _parity import agree

import fastpar
from fastpar.nn.loss import VocabParallelCrossEntropy
from fastpar.ops.cross_entropy import vocab_parallel_cross_entropy
from fastpar.testing import RankError, run_ranks

GARBAGE = 1.0e4  # written into padding columns: must never reach the loss or the gradient


@dataclass(frozen=True)
class Case(LossCase):
    scale: float = 3.0  # of the logits


CASES = [
    Case(),
    Case(reduction="sum", seed=1),
    Case(reduction="none", seed=2),
    Case(vocab=123, padded=True, seed=3),
    Case(vocab=123, padded=True, reduction="none", label_smoothing=0.1, z_loss=1e-3, seed=4),
    Case(shape=(5, 7), vocab=123, padded=True, reduction="sum", label_smoothing=0.1, seed=5),
    Case(shape=(5, 7), vocab=128, label_smoothing=0.1, z_loss=1e-3, seed=6),
    Case(z_loss=1e-3, reduction="sum", seed=7),
    Case(ignore_index=3, n_ignored=4, label_smoothing=0.2, seed=8),
    Case(n_ignored=13, seed=9),  # every target ignored: mean is 0, gradient 0
    Case(n_ignored=13, reduction="sum", z_loss=1e-3, seed=10),
    Case(scale=1.0e4, seed=11),
    Case(scale=1.0e4, vocab=123, padded=True, reduction="none", label_smoothing=0.1, seed=12),
    Case(shape=(3, 2, 4), vocab=123, padded=True, dtype=torch.bfloat16, seed=13),
    Case(vocab=123, padded=True, dtype=torch.bfloat16, label_smoothing=0.1, z_loss=1e-3, seed=14),
    Case(vocab=128, dtype=torch.float16, reduction="none", seed=15),
    Case(shape=(), vocab=123, padded=True, n_ignored=0, seed=16),  # one unbatched row
    Case(shape=(1,), vocab=5, padded=True, reduction="sum", seed=17),  # a rank of only padding
]


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(full logits [*shape, V] in case.dtype, target [*shape] int64, upstream gradient)."""
    gen = torch.Generator().manual_seed(case.seed)
    full = (torch.randn(*case.shape, case.vocab, generator=gen) * case.scale).to(case.dtype)
    target = torch.randint(0, case.vocab, case.shape, generator=gen)
    return full, target, ignore_and_upstream(target, case, gen)


def _shard(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s columns of ``full`` padded to ``tp·ceil(V/tp)`` with GARBAGE."""
    n_local = math.ceil(full.shape[-1] / tp)
    pad = torch.full((*full.shape[:-1], n_local * tp - full.shape[-1]), GARBAGE, dtype=full.dtype)
    return torch.cat([full, pad], dim=-1)[..., rank * n_local : (rank + 1) * n_local]


def _references(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[single, exact]: (loss, gradient of the full logits [*shape, V]) from torch in fp32 (the
    gradient then stored in ``case.dtype``, as the op stores it) and in float64."""
    full, target, upstream = _inputs(case)
    out = []
    for dtype in (torch.float32, torch.float64):
        x = full.to(dtype, copy=True).requires_grad_()
        loss = case_loss(x.reshape(-1, case.vocab), target.reshape(-1), case)
        (loss * upstream.to(dtype)).sum().backward()
        grad = x.grad if dtype == torch.float64 else x.grad.to(case.dtype)
        out.append((loss.detach(), grad))
    return out


def _length(case: Case) -> int:
    """The longest sum feeding a loss or a gradient: the vocabulary, or the rows a reduction
    adds."""
    return max(case.vocab, math.prod(case.shape))


def _run_cases(cases: list[Case], group_size: int | None = None) -> bytes:
    """On each rank: loss and shard gradient of every case (on subgroups when ``group_size``),
    pickled."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group, tp, tp_rank = None, world, rank
    if group_size is not None:
        subgroups = [
            dist.new_group(list(range(s, s + group_size))) for s in range(0, world, group_size)
        ]
        group, tp, tp_rank = subgroups[rank // group_size], group_size, rank % group_size
    out = []
    for case in cases:
        full, target, upstream = _inputs(case)
        shard = _shard(full, tp, tp_rank).requires_grad_()
        loss = vocab_parallel_cross_entropy(
            shard,
            target,
            group=group,
            vocab_size=case.vocab if case.padded else None,
            **loss_options(case),
        )
        (loss * upstream).sum().backward()
        out.append((loss.detach(), shard.grad))
    return pickle.dumps(out)


def _ranks(*args) -> list:
    return [pickle.loads(r) for r in run_ranks(_run_cases, *args)]


def _check(case: Case, results: list, tp: int, case_index: int) -> None:
    (single_loss, single_grad), (exact_loss, exact_grad) = _references(case)
    n_local = math.ceil(case.vocab / tp)

    def padded(grad: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros(*case.shape, n_local * tp - case.vocab, dtype=grad.dtype)
        return torch.cat([grad, pad], dim=-1)

    single_grad, exact_grad = padded(single_grad), padded(exact_grad)
    for rank, per_case in enumerate(results):
        loss, grad = per_case[case_index]
        where = f"{case} tp={tp} rank={rank}"
        assert grad.dtype == case.dtype, where
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), where
        assert_loss_agrees(loss, single_loss, exact_loss, where, length=_length(case))
        cols = slice(rank * n_local, (rank + 1) * n_local)
        agree(
            grad,
            single_grad[..., cols],
            exact_grad[..., cols],
            f"{where}: gradient",
            length=_length(case),
            dtype=case.dtype,
        )
        padding_cols = [c for c in range(n_local) if rank * n_local + c >= case.vocab]
        assert (grad[..., padding_cols] == 0).all(), f"{where}: padding columns got a gradient"


def test_tp1_in_process_equals_cross_entropy():
    """No process group at all: the op is F.cross_entropy (plus z-loss) on the whole vocab."""
    results = [_run_cases_local(CASES)]
    for i, case in enumerate(CASES):
        _check(case, results, 1, i)


def _run_cases_local(cases: list[Case]) -> list:
    out = []
    for case in cases:
        full, target, upstream = _inputs(case)
        x = full.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, **loss_options(case))
        (loss * upstream).sum().backward()
        out.append((loss.detach(), x.grad))
    return out


def test_tp1_matches_torch_reductions_directly():
    """Against F.cross_entropy's own reductions (not re-derived), odd shape [5, 7, V]: torch's
    in fp32 and in float64, by the rule."""
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(5, 7, 123, generator=gen).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    t = torch.randint(0, 123, (5, 7), generator=gen)
    t[0, :3] = -100
    for reduction in ("mean", "sum", "none"):
        for alpha in (0.0, 0.1):
            got = vocab_parallel_cross_entropy(x, t, reduction=reduction, label_smoothing=alpha)
            kw = dict(reduction=reduction, label_smoothing=alpha)
            want = F.cross_entropy(x.permute(0, 2, 1), t, **kw)
            want64 = F.cross_entropy(x64.permute(0, 2, 1), t, **kw)
            what = f"reduction={reduction} label_smoothing={alpha}"
            agree(got, want.detach(), want64.detach(), f"{what}: loss", length=123)
            g_got = torch.autograd.grad(got.sum(), x)[0]
            g_want = torch.autograd.grad(want.sum(), x)[0]
            g_want64 = torch.autograd.grad(want64.sum(), x64)[0]
            agree(g_got, g_want, g_want64, f"{what}: gradient", length=123)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parity_against_full_logits(tp):
    results = _ranks(tp, CASES)
    for i, case in enumerate(CASES):
        _check(case, results, tp, i)


def test_subgroups_of_two_in_a_world_of_four():
    """``group`` is honoured: two independent TP groups of 2, neither talks to the other."""
    cases = [CASES[4], CASES[6]]
    results = _ranks(4, cases, 2)
    for i, case in enumerate(cases):
        _check(case, results[:2], 2, i)
        _check(case, results[2:], 2, i)


def test_module_forward_and_repr():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 50, generator=gen, requires_grad=True)
    t = torch.randint(0, 50, (6,), generator=gen)
    loss_fn = VocabParallelCrossEntropy(label_smoothing=0.1, reduction="sum")
    kw = dict(label_smoothing=0.1, reduction="sum")
    want, want64 = F.cross_entropy(x, t, **kw), F.cross_entropy(x.double(), t, **kw)
    agree(loss_fn(x, t).detach(), want.detach(), want64.detach(), "module loss", length=50)
    assert "label_smoothing=0.1" in repr(loss_fn)
    with pytest.raises(ValueError, match="reduction"):
        VocabParallelCrossEntropy(reduction="avg")


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 10)
    t = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=r"logits \(4, 10\) must be target's shape \(5,\)"):
        vocab_parallel_cross_entropy(x, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="must be target's shape"):
        vocab_parallel_cross_entropy(x[None], t)
    with pytest.raises(TypeError, match=r"integer class ids.*torch.float32"):
        vocab_parallel_cross_entropy(x, t.float())
    with pytest.raises(TypeError, match="float32, bfloat16, float16 or float64"):
        vocab_parallel_cross_entropy(x.half().to(torch.int32), t)
    with pytest.raises(ValueError, match=r"reduction must be one of .* got 'avg'"):
        vocab_parallel_cross_entropy(x, t, reduction="avg")
    for alpha in (1.0, -0.1):
        with pytest.raises(ValueError, match=rf"label_smoothing must be in \[0, 1\), got {alpha}"):
            vocab_parallel_cross_entropy(x, t, label_smoothing=alpha)
    with pytest.raises(ValueError, match="z_loss must be >= 0"):
        vocab_parallel_cross_entropy(x, t, z_loss=-1.0)
    with pytest.raises(
        ValueError, match=r"vocab_size=11 does not fit shards of 10 columns on 1 ranks"
    ):
        vocab_parallel_cross_entropy(x, t, vocab_size=11)
    for bad_id in (10, -1, 12345):
        bad = t.clone()
        bad[2] = bad_id
        with pytest.raises(RuntimeError, match=r"target id is outside \[0, 10\).*ignore_index"):
            vocab_parallel_cross_entropy(x, bad)
    ok = t.clone()
    ok[1] = -100  # ignore_index is not an out-of-range id
    vocab_parallel_cross_entropy(x, ok)
    vocab_parallel_cross_entropy(x, t.int())  # int32 ids are accepted


def _padding_id_rejected() -> str:
    """tp=2, V=7: shards of 4, global id 7 is padding, not a vocabulary entry."""
    x = torch.randn(3, 4)
    t = torch.tensor([0, 7, 6])
    try:
        vocab_parallel_cross_entropy(x, t, vocab_size=7)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_padding_id_rejected_on_every_rank():
    messages = run_ranks(_padding_id_rejected, 2)
    assert all("outside [0, 7)" in m for m in messages), messages


def test_rank_error_surfaces():
    """A bad call on ranks is reported by the harness with the message intact."""

    def bad():
        return vocab_parallel_cross_entropy(torch.randn(2, 3), torch.zeros(2), reduction="mean")

    with pytest.raises(RankError, match="integer class ids"):
        run_ranks(bad, 2)


# ---------------------------------------------------------------- ranks that disagree


def _disagreeing_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(6, 99, generator=gen) * 3
    return full, torch.randint(0, 99, (6,), generator=gen)


def _disagreeing_calls(group_size: int) -> bytes:
    """On each rank, vocab-parallel CE calls in which the ranks of a group pass inconsistent
    inputs (debug checks off: the free checks), then a consistent one; every call's loss or
    error message, pickled. V = 99 on groups of ``group_size``: shards of 50 | 49 + 1 pad."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + group_size))) for s in range(0, world, group_size)]
    group, r = groups[rank // group_size], rank % group_size
    second_group = rank >= group_size
    full, target = _disagreeing_inputs()
    padded = _shard(full, 2, r)  # [6, 50]: the documented layout
    unpadded = full[:, :50] if r == 0 else full[:, 50:]  # [6, 50] | [6, 49]: what a user did
    flipped = target.flip(0) if r == 1 else target
    one_ignored = target.clone()
    if r == 1:
        one_ignored[2] = -100

    calls = {
        "widths": lambda: vocab_parallel_cross_entropy(unpadded, target, group=group),
        "widths, vocab_size given": lambda: vocab_parallel_cross_entropy(
            unpadded, target, group=group, vocab_size=99
        ),
        "targets": lambda: vocab_parallel_cross_entropy(
            padded, flipped, group=group, vocab_size=99
        ),
        "one row ignored on one rank": lambda: vocab_parallel_cross_entropy(
            padded, one_ignored, group=group, vocab_size=99
        ),
        "ignore_index": lambda: vocab_parallel_cross_entropy(
            padded, target, group=group, vocab_size=99, ignore_index=-100 - r
        ),
        "consistent": lambda: vocab_parallel_cross_entropy(
            padded, target, group=group, vocab_size=99
        ),
    }
    if second_group:  # only the second group disagrees: the first is not disturbed by it
        calls = {"second group widths": calls["widths"], "consistent": calls["consistent"]}
    out = {}
    with fastpar.debug_checks(False):  # the free checks alone (the suite may run with them on)
        for name, call in calls.items():
            try:
                out[name] = call()
            except ValueError as exc:
                out[name] = str(exc)
    return pickle.dumps(out)


def _consistent_loss_agrees(results: list) -> None:
    """Every rank's loss of the consistent call against F.cross_entropy in fp32 and float64."""
    full, target = _disagreeing_inputs()
    single, exact = F.cross_entropy(full, target), F.cross_entropy(full.double(), target)
    for rank, r in enumerate(results):
        agree(r["consistent"], single, exact, f"rank {rank}: consistent call's loss", length=99)


def test_ranks_that_disagree_raise_on_every_rank_naming_the_values():
    results = [pickle.loads(r) for r in run_ranks(_disagreeing_calls, 2, 2, timeout=120)]
    msgs = results[0]
    for name, msg in msgs.items():  # the same error on both ranks
        assert name == "consistent" or results[1][name] == msg, name
    assert msgs["widths"] == (
        "vocab_parallel_cross_entropy: the 2 ranks of the group disagree: shard width "
        "(logits.shape[-1]) 50 on rank 0, 49 on rank 1; vocab_size 100 on rank 0, 98 on rank 1; "
        "every rank must hold ceil(vocab_size / tp) columns (pad the last shard and pass "
        "vocab_size=) and the same target ids"
    )
    assert (
        "shard width (logits.shape[-1]) 50 on rank 0, 49 on rank 1; every rank"
        in (msgs["widths, vocab_size given"])
    )
    for name in ("targets", "one row ignored on one rank"):
        assert msgs[name].startswith(
            "vocab_parallel_cross_entropy: the 2 ranks of the group disagree: target ids digest "
        ), msgs[name]
        assert "on rank 0, digest" in msgs[name] and "shard width" not in msgs[name]
    assert "ignore_index -100 on rank 0, -101 on rank 1" in msgs["ignore_index"]
    _consistent_loss_agrees(results)  # after all of that the group still computes the right loss


def test_a_disagreeing_subgroup_names_global_ranks_and_leaves_the_other_alone():
    results = [pickle.loads(r) for r in run_ranks(_disagreeing_calls, 4, 2, timeout=120)]
    _consistent_loss_agrees(results)
    for r in results[2:]:
        assert "50 on rank 0 (global 2), 49 on rank 1 (global 3)" in r["second group widths"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_backward_writes_the_same_gradient_over_the_logits(dtype, reduction):
    """``inplace_backward=True``: the gradient, bit for bit the out-of-place one, lands in the
    logits buffer itself (one [N, V] buffer at the peak instead of two)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 13, generator=g).to(dtype)
    target = torch.randint(0, 13, (9,), generator=g)
    target[2] = -100
    kw = dict(label_smoothing=0.1, z_loss=1e-3, reduction=reduction)
    a = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(a, target, **kw)
    (loss.sum() if reduction == "none" else loss).backward()
    buf = logits.clone()
    b = buf.view_as(buf).requires_grad_()  # a leaf over the buffer: its grad is the buffer
    b_loss = vocab_parallel_cross_entropy(b, target, inplace_backward=True, **kw)
    # bit for bit: the same forward, and the same gradient arithmetic in the same order (the
    # reference's grad_logits with in_place=True writes the same values into the logits)
    torch.testing.assert_close(b_loss, loss, rtol=0, atol=0)
    (b_loss.sum() if reduction == "none" else b_loss).backward()
    assert torch.equal(b.grad, a.grad)
    assert b.grad.data_ptr() == b.data_ptr()  # written over the logits, no second buffer
    assert torch.equal(b.detach(), a.grad)
