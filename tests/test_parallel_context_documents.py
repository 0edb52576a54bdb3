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
from _mesh import make_mesh
from _parity import exact_copy, local_slice

from fastpar.models import GPTConfig, LlamaConfig, build_gpt, build_llama, lm_loss
from fastpar.models.documents import Documents, documents
from fastpar.nn.marks import param_layout
from fastpar.ops.documents import dense_document_attention
from fastpar.parallel import context
from fastpar.parallel.context import (
    all_to_all_attention,
    measure_waits,
    ring_attention,
    split_sequence,
)
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree, nudge


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


def _reference(q, k, v, g, ids, dtype=torch.float32, twin=False):
    """The dense reference on the whole rows in ``dtype`` (``twin``: inputs one ulp away):
    (output, [dq, dk, dv]), each of this rank's tokens."""
    leaves = [t.to(dtype).clone() for t in (q, k, v)]
    if twin:
        nudge(leaves, seed=1)
    leaves = [t.requires_grad_() for t in leaves]
    out = dense_document_attention(*leaves, ids)
    (out * g.to(dtype)).sum().backward()
    mine = lambda t: split_sequence(t.detach(), None, dim=2)  # noqa: E731
    return mine(out), [mine(t.grad) for t in leaves]


def _check(hq, hkv, chunk, kind, math_only):
    if math_only:  # the fp32 math of the blocks instead of the CPU flash kernels
        context._flash_cpu = lambda q: False
    cp = dist.get_world_size()
    seq = 2 * cp * chunk
    ids = _doc_ids(seq, chunk)
    q, k, v, g = _inputs(hq, hkv, seq)
    runs = [_reference(q, k, v, g, ids), _reference(q, k, v, g, ids, twin=True)]
    exact = _reference(q, k, v, g, ids, torch.float64)
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
    assert_agree(
        out,
        [r[0] for r in runs],
        exact[0],
        length=length,
        what=f"{kind} attention output on cp rank {rank}",
    )
    for i, (name, got) in enumerate(zip("qkv", mine, strict=True)):
        assert_agree(
            got.grad,
            [r[1][i] for r in runs],
            exact[1][i],
            length=length,
            what=f"{kind} d{name} on cp rank {rank}",
        )
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

VOCAB, SEQ = 53, 16
DOCS = torch.stack([_row([3, 6, 1], SEQ), _row([9, 7], SEQ, first_id=4)])  # chunks of 4 at cp 2
MODELS = {
    "gpt-cp2": ("gpt", dict(cp=2), {}),
    "llama-gqa-cp2": ("llama", dict(cp=2), dict(kv_heads=2)),
    "llama-gqa-cp2-a2a": ("llama", dict(cp=2), dict(kv_heads=2, cp_attention="all-to-all")),
}


def _model(kind: str, mesh, extra: dict):
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2, **extra)
    if kind == "llama":
        cfg = LlamaConfig(**base)
        return cfg, torch.nn.Sequential(*build_llama(cfg, mesh))
    cfg = GPTConfig(**base)
    return cfg, torch.nn.Sequential(*build_gpt(cfg, mesh))


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _model_reference(kind: str, extra: dict):
    """The single-process model inside the documents: loss and gradients of fp32, its twin and
    float64; and the longest reduction."""
    cfg, ref = _model(kind, None, extra)
    twin, exact = exact_copy(ref).float(), exact_copy(ref)
    nudge(twin, seed=1)
    ids = _ids()
    losses, grads = [], []
    for model in (ref, twin, exact):
        with documents(Documents.of(DOCS)):
            loss = lm_loss(model(ids), ids, cfg)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return losses, grads, reduction_length(ref, ids)


def _model_step(kind: str, layout: dict, extra: dict, ref_losses, refs, length):
    mesh = make_mesh(**layout)
    cfg, model = _model(kind, mesh, extra)
    ids = _ids()
    with documents(Documents.of(DOCS)):
        loss = lm_loss(model(ids), ids, cfg, mesh)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=mesh.cp_group)
    where = f"cp rank {mesh.cp_rank}"
    assert_agree(
        mean / mesh.cp_size,
        ref_losses[:2],
        ref_losses[2],
        length=length,
        what=f"loss (mean over cp) on {where}",
    )
    count = 0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.cp_group)
        grad /= mesh.cp_size
        sharded = param_layout(p) is not None and param_layout(p).kind == "sharded"
        single, twin, exact = (
            local_slice(r[name], p, param_layout(p).fused) if sharded else r[name] for r in refs
        )
        assert_agree(
            grad,
            [single, twin],
            exact,
            length=length,
            what=f"grad of {name} (mean over cp) on {where}",
        )
        count += 1
    assert count == len(refs[0])
    return count


@pytest.mark.parametrize("name", list(MODELS))
def test_models_under_cp_with_documents_equal_the_single_process_model(name):
    kind, layout, extra = MODELS[name]
    refs = _model_reference(kind, extra)
    counts = run_ranks(_model_step, layout["cp"], kind, layout, extra, *refs)
    assert len(set(counts)) == 1 and counts[0] > 0


def test_the_documents_change_the_model():
    """The documents matter here (else the model test would not test them): the packed
    model's loss differs from plain causal rows."""
    kind, _, extra = MODELS["gpt-cp2"]
    cfg, model = _model(kind, None, extra)
    ids = _ids()
    with torch.no_grad():
        plain = lm_loss(model(ids), ids, cfg)
        with documents(Documents.of(DOCS)):
            packed = lm_loss(model(ids), ids, cfg)
    assert abs(float(plain) - float(packed)) > 1e-3
