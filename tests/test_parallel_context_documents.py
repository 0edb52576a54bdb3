"""Packed documents under context parallelism (``fastpar.parallel.context``, ``doc_ids=``): ring
and all-to-all attention at cp 2 and 4 on gloo CPU ranks against the single-process dense
reference (``fastpar.ops.documents.dense_document_attention``: a query sees the keys of its own
document at or before it) — the output and dq, dk, dv of each rank's tokens — with
grouped-query attention, documents that cross chunk boundaries, documents shorter than a
chunk, a row that is one document and rows of different layouts in one batch (so a block one
row's queries see and another row's do not: the −inf log-sum-exp path), through torch's CPU
flash kernels and through the fp32 math. Blocks no query sees are skipped (counted by
``measure_waits``), and the GPT and the Llama under cp 2 inside ``documents(...)`` equal the
single-process models.

Not bit for bit (the blocks merge with an online softmax): each quantity is judged by
``fastpar.tolerance``'s rule against the float64 reference, with the fp32 reference and its
twin (inputs one ulp away) as the measure of rounding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _context import SEQ, agree_attention, attention_runs, cp_step, references, token_ids
from _context import model as context_model

from fastpar.models import lm_loss
from fastpar.models.documents import Documents, documents
from fastpar.ops.documents import dense_document_attention
from fastpar.parallel.context import (
    all_to_all_attention,
    measure_waits,
    ring_attention,
    split_sequence,
)
from fastpar.parallel.context import ring as context
from fastpar.testing import run_ranks


def _row(pattern: list[int], seq: int, first_id: int = 0) -> torch.Tensor:
    """Document ids [seq]: documents of the lengths in ``pattern`` (cycled, the last cut at
    ``seq``), numbered from ``first_id``."""
    lengths, total, i = [], 0, 0
    while total < seq:
        n = min(pattern[i % len(pattern)], seq - total)
        lengths.append(n)
        total, i = total + n, i + 1
    ids = torch.arange(first_id, first_id + len(lengths))
    return torch.repeat_interleave(ids, torch.tensor(lengths))


def _doc_ids(seq: int, chunk: int) -> torch.Tensor:
    """[4, seq]: rows of different layouts."""
    return torch.stack(
        [
            _row([chunk + 2, 2, 2 * chunk - 1], seq),  # across chunk boundaries, one < a chunk
            _row([seq], seq, first_id=7),  # one document
            _row([1, 2, 3], seq, first_id=100),  # many short documents
            _row([seq - 1, 1], seq, first_id=3),  # a long one and a last one-token document
        ]
    )


def _inputs(hq, hkv, seq, d=8, b=4):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, h, seq, d, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(b, hq, seq, d, generator=g)


def _check(hq, hkv, chunk, kind, math_only):
    if math_only:  # the fp32 math of the blocks instead of the CPU flash kernels
        context._flash_cpu = lambda q: False
    cp = dist.get_world_size()
    seq = 2 * cp * chunk
    ids = _doc_ids(seq, chunk)
    q, k, v, g = _inputs(hq, hkv, seq)
    dense = lambda q, k, v: dense_document_attention(q, k, v, ids)  # noqa: E731
    runs, exact = attention_runs(dense, q, k, v, g)
    mine = [split_sequence(t, None, dim=2).clone().requires_grad_() for t in (q, k, v)]
    attention = ring_attention if kind == "ring" else all_to_all_attention
    with measure_waits() as stats:
        out = attention(*mine, doc_ids=ids)
    (out * split_sequence(g, None, dim=2)).sum().backward()
    rank = dist.get_rank()
    for name, t in [("output", out)] + [
        (f"d{n}", t.grad) for n, t in zip("qkv", mine, strict=True)
    ]:
        assert torch.isfinite(t).all(), f"{name} on cp rank {rank} is not finite"
    length = max(seq, q.shape[-1])
    agree_attention(out, mine, runs, exact, length, f"{kind} on cp rank {rank}")
    if kind == "ring":  # mixed rows: a row of many documents makes every block masked
        assert stats["blocks_total"] > 0 and stats["blocks_masked"] > 0
    return True


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("hq,hkv,chunk", [(4, 4, 5), (8, 2, 3), (4, 1, 4)])
@pytest.mark.parametrize("kind", ["ring", "a2a"])
def test_attention_stops_at_documents_under_cp(cp, hq, hkv, chunk, kind):
    assert all(run_ranks(_check, cp, hq, hkv, chunk, kind, False))


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_with_documents_in_fp32_math(cp):
    assert all(run_ranks(_check, cp, 6, 3, 5, "ring", True))


def _skips(chunk: int, math_only: bool) -> dict:
    """Rows of documents of 2 tokens, none crossing a chunk boundary (even chunk): only the
    diagonal blocks have a query that sees a key."""
    if math_only:
        context._flash_cpu = lambda q: False
    cp = dist.get_world_size()
    seq = 2 * cp * chunk
    ids = torch.stack([_row([2], seq), _row([2], seq, first_id=50)])
    q, k, v, g = _inputs(4, 2, seq, b=2)
    mine = [split_sequence(t, None, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with measure_waits() as stats:
        out = ring_attention(*mine, doc_ids=ids)
    (out * split_sequence(g, None, dim=2)).sum().backward()
    for t in (out, *(t.grad for t in mine)):
        assert torch.isfinite(t).all()
    ref = split_sequence(dense_document_attention(q.double(), k.double(), v.double(), ids), None, 2)
    assert (out.double() - ref).abs().max() < 1e-5
    return {k: stats[k] for k in ("blocks_total", "blocks_skipped", "blocks_masked")}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("math_only", [False, True])
def test_blocks_no_query_sees_are_skipped(cp, math_only):
    for r, stats in enumerate(run_ranks(_skips, cp, 4, math_only)):
        # a rank's queries against the whole sequence's keys: the causal blocks b <= a of its
        # chunks i and 2cp-1-i: (i + 1) + (2cp - i) = 2cp + 1 of them, two diagonal
        assert stats["blocks_total"] == 2 * cp + 1, (r, stats)
        assert stats["blocks_skipped"] == 2 * cp - 1, (r, stats)
        assert stats["blocks_masked"] == 2, (r, stats)


def _one_document() -> bool:
    """Rows that are one document each: the plain causal blocks, bit for bit ring attention
    without documents, nothing skipped or masked."""
    cp = dist.get_world_size()
    seq = 2 * cp * 3
    ids = torch.stack([_row([seq], seq), _row([seq], seq, first_id=9)])
    q, k, v, g = _inputs(4, 2, seq, b=2)
    outs, grads = [], []
    for doc_ids in (None, ids):
        mine = [split_sequence(t, None, dim=2).clone().requires_grad_() for t in (q, k, v)]
        with measure_waits() as stats:
            out = ring_attention(*mine, doc_ids=doc_ids)
        (out * split_sequence(g, None, dim=2)).sum().backward()
        outs.append(out)
        grads.append([t.grad for t in mine])
    assert stats["blocks_skipped"] == 0 and stats["blocks_masked"] == 0
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    return True


def test_one_document_rows_run_the_plain_blocks():
    assert all(run_ranks(_one_document, 2))


def _bad_ids() -> str:
    q = torch.randn(1, 2, 4, 8)
    ids = torch.tensor([[0, 0, 1, 1, 2, 2, 1, 3]])
    try:
        ring_attention(q, q, q, doc_ids=ids)
    except ValueError as e:
        return str(e)
    return ""


def test_doc_ids_are_checked():
    assert "non-decreasing" in run_ranks(_bad_ids, 2)[0]


# the models under cp 2 inside documents(...) against the single-process models

DOCS = torch.stack([_row([3, 6, 1], SEQ), _row([9, 7], SEQ, first_id=4)])  # chunks of 4 at cp 2
MODELS = {
    "gpt-cp2": ("gpt", dict(cp=2), {}),
    "llama-gqa-cp2": ("llama", dict(cp=2), dict(kv_heads=2)),
    "llama-gqa-cp2-a2a": ("llama", dict(cp=2), dict(kv_heads=2, cp_attention="all-to-all")),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_models_under_cp_with_documents_equal_the_single_process_model(name):
    kind, layout, extra = MODELS[name]
    refs = references(kind, extra, DOCS)
    counts = run_ranks(cp_step, layout["cp"], kind, layout, extra, DOCS, *refs)
    assert len(set(counts)) == 1 and counts[0] > 0


def test_the_documents_change_the_model():
    """The documents matter here (else the model test would not test them): the packed
    model's loss differs from plain causal rows."""
    kind, _, extra = MODELS["gpt-cp2"]
    cfg, model = context_model(kind, None, extra)
    ids, _ = token_ids()
    with torch.no_grad():
        plain = lm_loss(model(ids), ids, cfg)
        with documents(Documents.of(DOCS)):
            packed = lm_loss(model(ids), ids, cfg)
    assert abs(float(plain) - float(packed)) > 1e-3
