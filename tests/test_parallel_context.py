"""Ring attention (``fastpar.parallel.context``) at cp 1, 2 and 4 against full causal attention
on one process: the output and the gradients of q, k and v of this rank's tokens, with
grouped-query attention and odd head counts, sequences of 2·cp chunks of odd lengths, and the
load-balanced layout (rank i holds chunks i and 2cp−1−i).

Ring attention adds its blocks with an online softmax (fp32), in another order than one
attention over the whole sequence, and all-to-all attention runs torch's attention on other
shapes: neither is bit for bit. Each is judged by ``fastpar.tolerance``'s rule against full
attention in float64, with full attention in fp32 (and its twin, the inputs one ulp away) as
the measure of rounding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _context import agree_attention, attention_runs

from fastpar.parallel.context import (
    all_to_all_attention,
    local_positions,
    ring_attention,
    split_sequence,
)
from fastpar.testing import run_ranks


def _full(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _inputs(hq, hkv, seq, d=8, b=2):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, h, seq, d, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(b, hq, seq, d, generator=g)


def _check(hq, hkv, chunk, kind="ring"):
    cp = dist.get_world_size()
    seq = 2 * cp * chunk
    q, k, v, g = _inputs(hq, hkv, seq)
    runs, exact = attention_runs(_full, q, k, v, g)
    mine = [split_sequence(t, None, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = (ring_attention if kind == "ring" else all_to_all_attention)(*mine)
    (out * split_sequence(g, None, dim=2)).sum().backward()
    length = max(seq, q.shape[-1])  # a row of scores sums over the keys, dq too; dk, dv: queries
    agree_attention(out, mine, runs, exact, length, f"cp rank {dist.get_rank()}")
    return True


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("hq,hkv,chunk", [(4, 4, 3), (6, 3, 5), (3, 1, 2), (5, 5, 1)])
def test_ring_attention_equals_full_causal_attention(cp, hq, hkv, chunk):
    assert all(run_ranks(_check, cp, hq, hkv, chunk))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("hq,hkv,chunk", [(4, 4, 3), (8, 2, 5), (4, 1, 2)])
def test_all_to_all_attention_equals_full_causal_attention(cp, hq, hkv, chunk):
    assert all(run_ranks(_check, cp, hq, hkv, chunk, "a2a"))


def _odd_heads() -> str:
    q, k, v, _ = _inputs(3, 3, 8)
    try:
        all_to_all_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4])
    except ValueError as e:
        return str(e)
    return ""


def test_all_to_all_attention_needs_heads_divisible_by_cp():
    assert "3 query heads" in run_ranks(_odd_heads, 2)[0]


def test_load_balanced_layout():
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([local_positions(24, 3, r) for r in range(3)]).sort().values
    assert torch.equal(every, torch.arange(24))
    with pytest.raises(ValueError, match="not divisible by 4"):
        local_positions(10, 2, 0)
