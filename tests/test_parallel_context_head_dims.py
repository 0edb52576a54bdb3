"""Context-parallel attention with query/key heads of one size and value heads of another (as
DeepSeek-V3's latent attention: q/k 48 = nope 32 + rope 16, v 32), with the default softmax
scale 1/sqrt(q/k dim) and an explicit one (YaRN's): ring and all-to-all attention at cp 2 and 4
on gloo CPU ranks, with and without packed documents (through ``fastpar.models.common.attend``,
the entry point the models call), through torch's CPU flash kernels (which need one head dim:
ring attention pads with zeros) and through the fp32 block math. Each rank's output and dq, dk,
dv are judged by ``fastpar.tolerance``'s rule against single-process attention in float64, with
single-process fp32 attention and its twin (inputs one ulp away) as the measure of rounding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _context import agree_attention, attention_runs

from fastpar.models.common import attend
from fastpar.models.documents import documents
from fastpar.ops.documents import dense_document_attention, document_attention
from fastpar.parallel.context import all_to_all_attention, ring_attention, split_sequence
from fastpar.parallel.context import ring as context
from fastpar.testing import assert_agree, run_ranks

SCALE = 0.31  # not 1/sqrt(48) = 0.144 nor 1/sqrt(24) = 0.204: a scale the kernels must be given


def _doc_ids(seq: int, chunk: int) -> torch.Tensor:
    """[2, seq]: a row of documents across chunk boundaries and shorter than a chunk, and a row
    of short documents (blocks one row sees and the other does not)."""
    rows = []
    for lengths in ([chunk + 2, 2, 2 * chunk - 1], [1, 2, 3]):
        ids, n = [], 0
        while len(ids) < seq:
            ids += [n] * lengths[n % len(lengths)]
            n += 1
        rows.append(torch.tensor(ids[:seq]))
    return torch.stack(rows)


def _inputs(hq, hkv, seq, dqk, dv, b=2):
    g = torch.Generator().manual_seed(13)
    q = torch.randn(b, hq, seq, dqk, generator=g)
    k = torch.randn(b, hkv, seq, dqk, generator=g)
    v = torch.randn(b, hkv, seq, dv, generator=g)
    return q, k, v, torch.randn(b, hq, seq, dv, generator=g)


def _full(q, k, v, scale, ids):
    if ids is not None:
        return dense_document_attention(q, k, v, ids, scale)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _check(dqk, dv, scale, kind, docs, math_only, hq=4, hkv=2, chunk=3):
    if math_only:  # the fp32 math of the ring's blocks instead of the CPU flash kernels
        context._flash_cpu = lambda q: False
    cp = dist.get_world_size()
    seq = 2 * cp * chunk
    ids = _doc_ids(seq, chunk) if docs else None
    q, k, v, g = _inputs(hq, hkv, seq, dqk, dv)
    runs, exact = attention_runs(lambda q, k, v: _full(q, k, v, scale, ids), q, k, v, g)
    mine = [split_sequence(t, None, dim=2).clone().requires_grad_() for t in (q, k, v)]
    if docs:  # the models' entry point, inside packed documents
        with documents(ids):
            out = attend(*mine, dist.group.WORLD, kind, scale=scale)
    elif kind == "ring":
        out = ring_attention(*mine, scale=scale)
    else:
        out = all_to_all_attention(*mine, scale=scale)
    assert out.shape == (*q.shape[:2], 2 * chunk, dv)
    (out * split_sequence(g, None, dim=2)).sum().backward()
    length = max(seq, dqk, dv)  # a row of scores sums over the keys, dq too; dk, dv: queries
    rank = dist.get_rank()
    what = f"{kind} q/k {dqk} v {dv} scale {scale} docs {docs} on cp rank {rank}"
    for got in mine:
        assert got.grad.shape == got.shape
    agree_attention(out, mine, runs, exact, length, what)
    return True


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dqk,dv", [(48, 32), (24, 40)])
@pytest.mark.parametrize("scale", [None, SCALE])
@pytest.mark.parametrize("kind", ["ring", "all-to-all"])
def test_cp_attention_with_value_head_dim_unlike_query_key(cp, dqk, dv, scale, kind):
    assert all(run_ranks(_check, cp, dqk, dv, scale, kind, False, False))


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dqk,dv", [(48, 32), (24, 40)])
@pytest.mark.parametrize("kind", ["ring", "all-to-all"])
def test_cp_attention_head_dims_with_documents(cp, dqk, dv, kind):
    assert all(run_ranks(_check, cp, dqk, dv, SCALE, kind, True, False))


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("docs", [False, True])
def test_ring_attention_head_dims_in_fp32_math(cp, docs):
    assert all(run_ranks(_check, cp, 48, 32, SCALE, "ring", docs, True))


@pytest.mark.parametrize("docs", [False, True])
def test_attend_without_cp_takes_head_dims_and_scale(docs):
    seq = 12
    ids = _doc_ids(seq, 3) if docs else None
    q, k, v, _ = _inputs(4, 2, seq, 48, 32)
    exact = _full(q.double(), k.double(), v.double(), SCALE, ids)
    single = _full(q, k, v, SCALE, ids)
    with documents(ids):
        out = attend(q, k, v, scale=SCALE)
    assert_agree(out, single, exact, length=seq, what="attend without cp")
    if docs:
        got = document_attention(q, k, v, ids, SCALE)
        assert_agree(got, single, exact, length=seq, what="document_attention")


def test_query_and_key_head_dims_must_match():
    q, k, v, _ = _inputs(2, 2, 4, 48, 32)
    with pytest.raises(ValueError, match="ring_attention takes"):
        ring_attention(q, k[..., :40], v)
    with pytest.raises(ValueError, match="k \\[B, Hkv, T, D\\]"):
        document_attention(q, v, v, torch.zeros(2, 4, dtype=torch.long))
