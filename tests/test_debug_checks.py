"""The debug switch (``fastpar.debug``) and the cross-rank checks behind it, on 2 gloo ranks.

Each case feeds the ranks of a tensor-parallel group inputs that differ; with the debug checks
on, every rank must raise the same ``ValueError`` naming each rank's value (without them gloo
aborts the process). All cases of one world size run in one ``run_ranks`` call: a check raises
after its all-gather on every rank alike, so the ranks stay in step for the next case.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastpar
from fastpar.comm.checks import check_same, digest
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.ops.cross_entropy import vocab_parallel_cross_entropy
from fastpar.testing import run_ranks


def _linears():
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 6)
    row = RowParallelLinear(6, 4)
    seq = ColumnParallelLinear(8, 6, sequence_parallel=True)
    emb = VocabParallelEmbedding(20, 8)
    return col, row, seq, emb


def _cases() -> dict:
    """Name → a call whose inputs differ across the 2 ranks (rank r)."""
    r = dist.get_rank()
    col, row, seq, emb = _linears()
    ce_logits = torch.randn(3 + r, 10)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ids_other = ids.clone()
    ids_other[1, 2] = 19 if r else 6
    return {
        "column batch": lambda: col(torch.randn(4 + r, 8)),
        "column dtype": lambda: col.to(torch.bfloat16 if r else torch.float32)(
            torch.randn(4, 8, dtype=torch.bfloat16 if r else torch.float32)
        ),
        "row sequence": lambda: row(torch.randn(2, 5 + r, 3)),
        "sequence parallel chunk": lambda: seq(torch.randn(3 + r, 2, 8)),
        "embedding shape": lambda: emb(ids[:, : 2 + r]),
        "embedding ids": lambda: emb(ids_other),
        "cross-entropy rows": lambda: vocab_parallel_cross_entropy(
            ce_logits, torch.zeros(3 + r, dtype=torch.long)
        ),
        "cross-entropy label smoothing": lambda: vocab_parallel_cross_entropy(
            ce_logits[:3], torch.zeros(3, dtype=torch.long), label_smoothing=0.1 * r
        ),
        "different layers": lambda: (col if r == 0 else row)(torch.randn(4, 8 if r == 0 else 3)),
    }


def _disagreeing_ranks() -> bytes:
    out = {}
    with fastpar.debug_checks(True):
        for name, call in _cases().items():
            try:
                call()
                out[name] = "no error"
            except ValueError as exc:
                out[name] = str(exc)
    return pickle.dumps(out)


def test_inputs_that_differ_across_ranks_raise_on_every_rank():
    ranks = [pickle.loads(r) for r in run_ranks(_disagreeing_ranks, 2, timeout=120)]
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        if name != "different layers":  # there each rank names the call it is in
            assert ranks[0][name] == ranks[1][name], name
    m = ranks[0]
    assert m["column batch"] == (
        "ColumnParallelLinear(8, 6): the 2 ranks of the group disagree: input shape (4, 8) on "
        "rank 0, (5, 8) on rank 1; every rank of a tensor-parallel group must pass the same "
        "shapes (the same micro-batch)"
    )
    assert "input dtype torch.float32 on rank 0, torch.bfloat16 on rank 1" in m["column dtype"]
    assert "RowParallelLinear(6, 4): the 2 ranks" in m["row sequence"]
    assert "input shape (2, 5, 3) on rank 0, (2, 6, 3) on rank 1" in m["row sequence"]
    assert "input shape (3, 2, 8) on rank 0, (4, 2, 8) on rank 1" in m["sequence parallel chunk"]
    assert "ids shape (2, 2) on rank 0, (2, 3) on rank 1" in m["embedding shape"]
    assert m["embedding ids"].startswith(
        "VocabParallelEmbedding(20, 8): the 2 ranks of the group disagree: ids digest "
    )
    assert "must look up the same token ids" in m["embedding ids"]
    assert "logits shape (3, 10) on rank 0, (4, 10) on rank 1" in m["cross-entropy rows"]
    assert "label_smoothing 0.0 on rank 0, 0.1 on rank 1" in m["cross-entropy label smoothing"]
    assert (
        "the ranks of the group are not at the same call: rank 0 in ColumnParallelLinear(8, 6)"
        in (m["different layers"])
    )
    assert "rank 0 in RowParallelLinear(6, 4)" not in m["different layers"]
    assert ranks[1]["different layers"].startswith(
        "RowParallelLinear(6, 4): the ranks of the group are not at the same call: rank 1 in "
    )


def _agreeing_ranks() -> bytes:
    """The same inputs with the checks on and off: equal results, and the collectives each
    costs (debug off: none extra)."""
    calls = []
    real = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_reduce")}

    def counting(name):
        def collective(tensor, *args, **kwargs):  # the first tensor: the output of a gather
            calls.append((name, tensor.numel()))
            return real[name](tensor, *args, **kwargs)

        return collective

    for name in real:
        setattr(dist, name, counting(name))
    results = {}
    for on in (False, True):
        calls.clear()
        col, row, _, emb = _linears()
        torch.manual_seed(1)
        ids = torch.randint(0, 20, (2, 3))
        target = torch.randint(0, 6, (2, 3))
        with fastpar.debug_checks(on):
            h = row(F.gelu(col(emb(ids))))
            loss = vocab_parallel_cross_entropy(col(h.repeat(1, 1, 2)), target, vocab_size=6)
            loss.backward()
        grads = [p.grad.clone() for m in (col, row, emb) for p in m.parameters()]
        results[on] = (loss.detach(), grads, list(calls))
    for name, fn in real.items():
        setattr(dist, name, fn)
    return pickle.dumps(results)


def test_agreeing_ranks_pass_and_the_checks_cost_one_small_all_reduce_each_only_when_on():
    for res in (pickle.loads(r) for r in run_ranks(_agreeing_ranks, 2, timeout=120)):
        (loss_off, grads_off, calls_off), (loss_on, grads_on, calls_on) = res[False], res[True]
        # bit for bit: the checks only add a small all-reduce beside the same kernels
        torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=0)
        for a, b in zip(grads_on, grads_off, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # debug off: one all-gather, the cross-entropy's stats: its output holds 2 ranks ×
        # (3·2 rows + 2 header rows) × 4
        assert [c for c in calls_off if c[0] == "all_gather_into_tensor"] == [
            ("all_gather_into_tensor", 2 * 8 * 4)
        ]
        # debug on: the same, plus one (hash, -hash) all-reduce before each of the 4 layer
        # calls and the loss
        extra = list(calls_on)
        for c in calls_off:
            extra.remove(c)
        assert extra == [("all_reduce", 2)] * 5


def _summaries() -> list[str]:
    r = dist.get_rank()
    fields = [
        {"shape": tuple(range(2, 12 + r))},  # 10 / 11 dims: the tail is folded
        {"a float": 0.5 + r},
        {"a word": "mean" if r == 0 else "sum"},
        {"a digest": digest(torch.tensor([1, 2, 3 + r]))},
        {"a count": 7},
    ]
    out = []
    for f in fields:
        try:
            check_same("summary", f, None, torch.device("cpu"), "hint")
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_check_same_field_kinds():
    msgs = run_ranks(_summaries, 2, timeout=120)
    shape, fl, word, dig, count = msgs[0]
    assert (
        "shape (2, 3, 4, 5, 6, 7, 8, ... 10 dims) on rank 0, (2, 3, 4, 5, 6, 7, 8, ... 11 dims)"
        in shape
    )
    assert (
        fl
        == "summary: the 2 ranks of the group disagree: a float 0.5 on rank 0, 1.5 on rank 1; hint"
    )
    assert "a word 'mean' on rank 0, another value on rank 1" in word
    assert msgs[1][2].endswith("a word another value on rank 0, 'sum' on rank 1; hint")
    assert "a digest digest 0x" in dig
    assert count == "no error"


def test_digest_sees_any_single_change_and_order():
    ids = torch.arange(1000) % 97
    base = int(digest(ids))
    assert int(digest(ids.clone())) == base
    assert int(digest(ids.flip(0))) != base
    for i in (0, 500, 999):
        for delta in (1, -1, 1 << 40):
            changed = ids.clone()
            changed[i] += delta
            assert int(digest(changed)) != base, (i, delta)
    assert 0 <= base < 1 << 48
