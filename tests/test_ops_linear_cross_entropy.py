"""CPU tier: the fused linear cross-entropy on 1, 2 and 4 gloo ranks against F.linear + CE.

The references are torch on the full (unsharded) weight, from the very values each rank holds:
``F.cross_entropy(F.linear(h, W), t, label_smoothing=α) + z·logsumexp²`` with the reduction,
backward to d hidden and d weight — once in the inputs' dtype (the unfused single-process run:
the logits rounded to the inputs' dtype by F.linear, the loss in fp32, the gradients of the
matmuls in the inputs' dtype) and once in float64 (the exact math). Each rank holds rows
``[r·V_local, (r+1)·V_local)`` of the weight padded with GARBAGE rows (they must reach neither
the loss nor a gradient); its loss, d hidden (all-reduced over TP) and d weight shard must agree
with them by the rule of ``fastpar.tolerance`` (``_parity.agree``: error against float64 at most
4 x the single run's own + a floor), not within a fixed tolerance.
Every case of one world size runs in one ``run_ranks`` call; results travel pickled.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ce import (
    LossCase,
    assert_loss_agrees,
    case_loss,
    grad_spec,
    ignore_and_upstream,
    loss_options,
)
from _parity import agree
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import fastpar
from fastpar.nn.functional import (
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from fastpar.reference import cross_entropy as ce_ref
from fastpar.reference import linear_cross_entropy as ref
from fastpar.testing import run_ranks

GARBAGE = 50.0  # the padding rows of the weight


@dataclass(frozen=True)
class Case(LossCase):
    hidden: int = 24
    chunk_size: int | None = 4
    recompute: bool = False


CASES = [
    Case(),
    Case(reduction="sum", seed=1),
    Case(reduction="none", seed=2),  # always the recompute backward
    Case(vocab=123, padded=True, chunk_size=5, seed=3),  # odd chunks: 5 + 5 + 3
    Case(vocab=123, padded=True, reduction="none", label_smoothing=0.1, z_loss=1e-3, seed=4),
    Case(shape=(5, 7), vocab=123, hidden=17, padded=True, reduction="sum", label_smoothing=0.1),
    Case(shape=(5, 7), label_smoothing=0.1, z_loss=1e-3, chunk_size=None, seed=6),  # default
    Case(z_loss=1e-3, reduction="sum", recompute=True, seed=7),
    Case(ignore_index=3, n_ignored=4, label_smoothing=0.2, recompute=True, seed=8),
    Case(n_ignored=13, seed=9),  # every target ignored: mean 0, gradients 0
    Case(n_ignored=13, reduction="sum", z_loss=1e-3, recompute=True, seed=10),
    Case(chunk_size=64, seed=11),  # one chunk larger than N
    Case(shape=(1,), vocab=5, padded=True, reduction="sum", n_ignored=0, seed=12),  # pad-only rank
    Case(shape=(3, 2, 4), vocab=123, padded=True, dtype=torch.bfloat16, seed=13),
    Case(vocab=123, padded=True, dtype=torch.bfloat16, label_smoothing=0.1, z_loss=1e-3, seed=14),
    Case(dtype=torch.bfloat16, reduction="none", seed=15),
    Case(dtype=torch.float16, recompute=True, reduction="sum", seed=16),
]


def _inputs(case: Case):
    """(hidden [*shape, H], full weight [V, H] in case.dtype, target, upstream gradient)."""
    gen = torch.Generator().manual_seed(case.seed)
    hidden = torch.randn(*case.shape, case.hidden, generator=gen).to(case.dtype)
    weight = (torch.randn(case.vocab, case.hidden, generator=gen) * 0.5).to(case.dtype)
    target = torch.randint(0, case.vocab, case.shape, generator=gen)
    return hidden, weight, target, ignore_and_upstream(target, case, gen)


def _shard(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    n_local = math.ceil(weight.shape[0] / tp)
    pad = torch.full((n_local * tp - weight.shape[0], weight.shape[1]), GARBAGE, dtype=weight.dtype)
    return torch.cat([weight, pad])[rank * n_local : (rank + 1) * n_local]


def _references(case: Case, upstream: torch.Tensor | None = None) -> list[tuple]:
    """[single, exact]: (loss, d hidden, d weight [V, H]) of torch on the full weight, in
    ``case.dtype`` (the unfused single-process run: F.linear in the inputs' dtype, the loss of
    its logits in fp32) and in float64; ``upstream`` replaces the case's upstream gradient."""
    hidden, weight, target, case_upstream = _inputs(case)
    upstream = case_upstream if upstream is None else upstream
    out = []
    for dtype in (case.dtype, torch.float64):
        h = hidden.to(dtype, copy=True).requires_grad_()
        w = weight.to(dtype, copy=True).requires_grad_()
        logits = F.linear(h, w).reshape(-1, case.vocab)
        loss = case_loss(
            logits if dtype == torch.float64 else logits.float(), target.reshape(-1), case
        )
        (loss * upstream.to(loss.dtype)).sum().backward()
        out.append((loss.detach(), h.grad, w.grad))
    return out


def _length(case: Case) -> int:
    """The longest sum feeding the loss and the gradients: the hidden size (the logits), the
    vocabulary (the softmax, d hidden) or the rows (d weight)."""
    return max(case.hidden, case.vocab, math.prod(case.shape))


def _call(case: Case, hidden, weight, target, group=None, **kw):
    return vocab_parallel_linear_cross_entropy(
        hidden,
        weight,
        target,
        group=group,
        vocab_size=case.vocab if case.padded else None,
        chunk_size=case.chunk_size,
        recompute=case.recompute,
        **loss_options(case),
        **kw,
    )


def _run_cases(cases: list[Case]) -> bytes:
    """On each rank: (loss, d hidden, d weight shard) of every case, pickled."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for case in cases:
        hidden, weight, target, upstream = _inputs(case)
        h = hidden.clone().requires_grad_()
        w = _shard(weight, tp, rank).clone().requires_grad_()
        loss = _call(case, h, w, target)
        (loss * upstream).sum().backward()
        out.append((loss.detach(), h.grad, w.grad))
    return pickle.dumps(out)


def _check(case: Case, results: list, tp: int, i: int) -> None:
    (single_loss, single_h, single_w), (exact_loss, exact_h, exact_w) = _references(case)
    n_local = math.ceil(case.vocab / tp)

    def padded(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w, w.new_zeros(n_local * tp - case.vocab, case.hidden)])

    single_w, exact_w = padded(single_w), padded(exact_w)
    n = _length(case)
    for rank, per_case in enumerate(results):
        loss, gh, gw = per_case[i]
        where = f"{case} tp={tp} rank={rank}"
        assert gh.dtype == case.dtype and gw.dtype == case.dtype, where
        # the loss is fp32, from logits rounded to the inputs' dtype: judged in that dtype
        assert_loss_agrees(loss, single_loss, exact_loss, where, length=n, dtype=case.dtype)
        agree(gh, single_h, exact_h, f"{where}: d hidden", length=n, dtype=case.dtype)
        rows = slice(rank * n_local, (rank + 1) * n_local)
        agree(gw, single_w[rows], exact_w[rows], f"{where}: d weight", length=n, dtype=case.dtype)
        pad_rows = [j for j in range(n_local) if rank * n_local + j >= case.vocab]
        assert (gw[pad_rows] == 0).all(), f"{where}: padding rows got a gradient"


def test_tp1_in_process_equals_linear_plus_cross_entropy():
    results = [pickle.loads(_run_cases_local(CASES))]
    for i, case in enumerate(CASES):
        _check(case, results, 1, i)


def _run_cases_local(cases: list[Case]) -> bytes:
    out = []
    for case in cases:
        hidden, weight, target, upstream = _inputs(case)
        h, w = hidden.clone().requires_grad_(), _shard(weight, 1, 0).clone().requires_grad_()
        loss = _call(case, h, w, target)
        (loss * upstream).sum().backward()
        out.append((loss.detach(), h.grad, w.grad))
    return pickle.dumps(out)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parity_against_full_weight(tp):
    results = [pickle.loads(r) for r in run_ranks(_run_cases, tp, CASES)]
    for i, case in enumerate(CASES):
        _check(case, results, tp, i)


def _partial_hidden_grad() -> bytes:
    """reduce_hidden_grad=False: d hidden is this shard's partial sum (the caller reduces)."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    case = Case(vocab=123, padded=True, label_smoothing=0.1)
    hidden, weight, target, _ = _inputs(case)
    h = hidden.clone().requires_grad_()
    _call(case, h, _shard(weight, tp, rank), target, reduce_hidden_grad=False).backward()
    return pickle.dumps(h.grad)


def test_partial_hidden_grad_sums_to_the_full_one():
    parts = [pickle.loads(r) for r in run_ranks(_partial_hidden_grad, 2)]
    case = Case(vocab=123, padded=True, label_smoothing=0.1)
    (_, single_h, _), (_, exact_h, _) = _references(case, upstream=torch.tensor(1.0))
    assert not torch.allclose(parts[0].double(), exact_h, atol=1e-4)
    agree(
        parts[0] + parts[1], single_h, exact_h, "sum of the partial d hidden", length=_length(case)
    )


def _torch_linear_ce(h, w, t, **kw) -> list[tuple]:
    """[fp32, float64]: (loss, d hidden, d weight) of F.linear + F.cross_entropy, upstream 1."""
    out = []
    for dtype in (torch.float32, torch.float64):
        hh, ww = h.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()
        loss = F.cross_entropy(F.linear(hh, ww), t, **kw)
        loss.sum().backward()
        out.append((loss.detach(), hh.grad, ww.grad))
    return out


def test_reference_oracle_equals_torch():
    """``ref.linear_cross_entropy`` (single rank, chunked) against F.linear + F.cross_entropy,
    by the rule (torch's fp32 run and float64)."""
    gen = torch.Generator().manual_seed(5)
    h, w = torch.randn(29, 19, generator=gen), torch.randn(41, 19, generator=gen)
    t = torch.randint(0, 41, (29,), generator=gen)
    t[3] = -100
    for reduction in ("mean", "sum", "none"):
        single, exact = _torch_linear_ce(h, w, t, label_smoothing=0.1, reduction=reduction)
        for chunk in (1, 6, None):
            got = ref.linear_cross_entropy(
                h, w, t, reduction=reduction, label_smoothing=0.1, chunk_size=chunk
            )
            for name, a, b, c in zip(
                ("loss", "d hidden", "d weight"), got, single, exact, strict=True
            ):
                agree(a, b, c, f"{reduction} chunk={chunk}: {name}", length=41)


def test_default_chunk_size():
    assert ref.default_chunk_size(4096, 32768) == 256
    assert ref.default_chunk_size(100, 32768) == 100
    assert ref.default_chunk_size(10**6, 10**7) == ref.MIN_CHUNK
    assert ref.default_chunk_size(0, 10) == 1


def test_no_grad_and_frozen_inputs():
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(9, 8, generator=gen), torch.randn(20, 8, generator=gen)
    t = torch.randint(0, 20, (9,), generator=gen)
    want, want64 = F.cross_entropy(F.linear(h, w), t), F.cross_entropy(F.linear(h, w).double(), t)
    with torch.no_grad():
        agree(vocab_parallel_linear_cross_entropy(h, w, t), want, want64, "loss", length=20)
    for frozen_weight in (True, False):
        hh = h.clone().requires_grad_(frozen_weight)
        ww = w.clone().requires_grad_(not frozen_weight)
        loss = vocab_parallel_linear_cross_entropy(hh, ww, t, chunk_size=4)
        loss.backward()
        assert (ww.grad is None) == frozen_weight and (hh.grad is None) != frozen_weight


def test_backward_twice():
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(9, 8, generator=gen).requires_grad_()
    w = torch.randn(20, 8, generator=gen).requires_grad_()
    t = torch.randint(0, 20, (9,), generator=gen)
    loss = vocab_parallel_linear_cross_entropy(h, w, t, recompute=True)
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)
    loss = vocab_parallel_linear_cross_entropy(h, w, t)
    torch.autograd.grad(loss, (h, w), retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute=True"):
        torch.autograd.grad(loss, (h, w))


def test_bad_inputs_raise_clear_errors():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    f = vocab_parallel_linear_cross_entropy
    with pytest.raises(TypeError, match="share one dtype"):
        f(h, w.double(), t)
    with pytest.raises(TypeError, match="integer class ids"):
        f(h, w, t.float())
    with pytest.raises(ValueError, match=r"weight \(10, 7\) must be"):
        f(h, w[:, :7], t)
    with pytest.raises(ValueError, match=r"target's shape \(5,\)"):
        f(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction must be one of"):
        f(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        f(h, w, t, label_smoothing=1.0)
    with pytest.raises(ValueError, match="z_loss must be >= 0"):
        f(h, w, t, z_loss=-1.0)
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        f(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_size=11 does not fit"):
        f(h, w, t, vocab_size=11)
    bad = t.clone()
    bad[1] = 10
    with pytest.raises(RuntimeError, match=r"target id is outside \[0, 10\)"):
        f(h, w, bad)


@pytest.mark.parametrize(
    ("cols", "start", "n_valid", "scale"),
    [(123, 0, 123, 3.0), (123, 0, 100, 3.0), (64, 64, 40, 1.0e4), (8, 16, 0, 3.0)],
)
def test_inplace_stats_and_grad_match_the_cross_entropy_reference(cols, start, n_valid, scale):
    """``stats_`` + ``grad_`` (fp32 in place, through exp(x − m)) against the vocab-parallel CE's
    out-of-place ``local_stats`` / ``grad_logits`` in fp32 and in float64, by the rule; padding
    columns hold garbage."""
    gen = torch.Generator().manual_seed(cols + n_valid)
    x = torch.randn(7, cols, generator=gen) * scale
    x[:, n_valid:] = 1.0e4
    t = torch.randint(0, start + cols + 3, (7,), generator=gen)
    t[0] = -100
    want_stats = ce_ref.local_stats(x, t, start, n_valid, -100)
    exact_stats = ce_ref.local_stats(x.double(), t, start, n_valid, -100)
    buf = x.clone()
    local = ref.stats_(buf, t, start, n_valid, -100)
    n = max(n_valid, 1)  # the row's sums
    for col, name in enumerate(("row max", "sum of exp", "target logit", "logit sum")):
        agree(local[:, col], want_stats[:, col], exact_stats[:, col], name, length=n)
    other = torch.tensor([[1.5, 2.0, 0.0, 3.0]]).expand(7, 4)  # another shard's statistics
    row_max, log_s, _, _ = ce_ref.combine_stats(torch.stack([want_stats, other]))
    g = (torch.rand(7, generator=gen) + 0.1) * (t != -100)
    spec = grad_spec(start, n_valid, start + cols)
    got = ref.grad_(buf, t, local, row_max, log_s, g, **spec)
    assert got.data_ptr() == buf.data_ptr()
    want = ce_ref.grad_logits(x, t, row_max, log_s, g, **spec)
    exact = ce_ref.grad_logits(x.double(), t, row_max.double(), log_s.double(), g.double(), **spec)
    agree(got, want, exact, "gradient", length=n)
    # bit for bit: grad_logits_ is grad_logits written into the logits (the same arithmetic)
    assert torch.equal(ref.grad_logits_(x.clone(), t, row_max, log_s, g, **spec), want)


def _peak_bytes(run) -> int:
    """Peak bytes allocated above the start of ``run()`` (torch's CPU memory profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
    del out
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


def test_peak_memory_is_a_fraction_of_linear_plus_cross_entropy():
    """V=8k, N=1k, H=64, 128-row chunks: the fused step holds at most 1/8 of the bytes that
    F.linear + vocab_parallel_cross_entropy holds (d hidden and d weight counted on both)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1024, 64, generator=gen).requires_grad_()
    w = (torch.randn(8192, 64, generator=gen) * 0.1).requires_grad_()
    t = torch.randint(0, 8192, (1024,), generator=gen)
    fused = _peak_bytes(
        lambda: torch.autograd.grad(
            vocab_parallel_linear_cross_entropy(h, w, t, chunk_size=128), (h, w)
        )
    )
    unfused_ce = vocab_parallel_cross_entropy  # the models' loss today
    unfused = _peak_bytes(lambda: torch.autograd.grad(unfused_ce(F.linear(h, w), t), (h, w)))
    logits = 1024 * 8192 * 4
    assert unfused >= 2 * logits  # the logits and their gradient
    assert fused <= unfused / 8, (fused, unfused)


def _subgroup_cases(cases: list[Case]) -> bytes:
    """World 4 as two TP groups of 2 (``group`` honoured: neither talks to the other)."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, tp_rank = groups[rank // 2], rank % 2
    out = []
    for case in cases:
        hidden, weight, target, upstream = _inputs(case)
        h = hidden.clone().requires_grad_()
        w = _shard(weight, 2, tp_rank).clone().requires_grad_()
        (_call(case, h, w, target, group=group) * upstream).sum().backward()
        out.append((_call(case, h, w, target, group=group).detach(), h.grad, w.grad))
    return pickle.dumps(out)


def test_subgroups_of_two_in_a_world_of_four():
    cases = [CASES[4], CASES[5]]
    results = [pickle.loads(r) for r in run_ranks(_subgroup_cases, 4, cases)]
    for i, case in enumerate(cases):
        _check(case, results[:2], 2, i)
        _check(case, results[2:], 2, i)


def _disagreeing_widths() -> str:
    """V = 99 on 2 ranks, unpadded: shards of 50 | 49 rows (a layout error)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=gen), torch.randn(99, 8, generator=gen)
    t = torch.randint(0, 99, (6,), generator=gen)
    shard = w[:50] if rank == 0 else w[50:]
    try:
        vocab_parallel_linear_cross_entropy(h, shard, t, vocab_size=99, chunk_size=4)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_disagreeing_shard_widths_raise_on_every_rank():
    with fastpar.debug_checks(False):  # the free check in the first chunk's gather
        messages = run_ranks(_disagreeing_widths, 2)
    for m in messages:
        assert "50 on rank 0, 49 on rank 1" in m, m
