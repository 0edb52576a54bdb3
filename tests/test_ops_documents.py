"""fastpar.ops.documents: attention that stops at documents, against a float64 dense reference
judged by fastpar.tolerance's rule, and the context-parallel work count against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastpar import tolerance
from fastpar.ops.documents import (
    causal_work,
    dense_document_attention,
    document_attention,
    work_balance,
)
from fastpar.parallel.context import local_positions

T, D = 32, 16


def _ids(layouts):
    """[B, T] ids from per-row document lengths."""
    rows = []
    for lens in layouts:
        assert sum(lens) == T
        rows.append(torch.repeat_interleave(torch.arange(len(lens)) + 3, torch.tensor(lens)))
    return torch.stack(rows)


def _qkv(b, hq, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, T, D, generator=g),
        torch.randn(b, hkv, T, D, generator=g),
        torch.randn(b, hkv, T, D, generator=g),
    )


def _run(fn, qkv, ids, grad_out, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in qkv]
    out = fn(*leaves, ids)
    out.backward(grad_out.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


LAYOUTS = {
    "one-doc": [[T], [T]],
    "many-docs": [[4] * 8, [4] * 8],
    "length-1": [[1, 1, 5, 1, 24], [1] * T],
    "per-row": [[T], [10, 3, 19], [1, 15, 16]],
}


@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_float64_dense_reference(layout, heads):
    layouts = LAYOUTS[layout]
    ids = _ids(layouts)
    qkv = _qkv(len(layouts), *heads)
    grad_out = torch.randn(len(layouts), heads[0], T, D, generator=torch.Generator().manual_seed(1))
    actual = _run(document_attention, qkv, ids, grad_out, torch.float32)
    single = _run(dense_document_attention, qkv, ids, grad_out, torch.float32)
    twin_in = [t.clone() for t in qkv]
    tolerance.nudge(twin_in, seed=2)
    twin = _run(dense_document_attention, twin_in, ids, grad_out, torch.float32)
    exact = _run(dense_document_attention, qkv, ids, grad_out, torch.float64)
    also = _run(document_attention, qkv, ids, grad_out, torch.float64)  # float64 path works
    for name, a, s, tw, e, a64 in zip(
        ("out", "dq", "dk", "dv"), actual, single, twin, exact, also, strict=True
    ):
        tolerance.assert_agree(a, [s, tw], e, length=max(T, D), dtype=torch.float32, what=name)
        assert a64.dtype == torch.float64
        torch.testing.assert_close(a64, e, rtol=1e-10, atol=1e-10)


def test_other_documents_do_not_leak():
    ids = _ids([[10, 3, 19]])
    q, k, v = _qkv(1, 4, 2)
    out = document_attention(q, k, v, ids)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    for t in (k2, v2, q2):  # change every token outside document 1 (positions 10..12)
        t[:, :, :10] = torch.randn_like(t[:, :, :10]) * 5
        t[:, :, 13:] = torch.randn_like(t[:, :, 13:]) * 5
    out2 = document_attention(q2, k2, v2, ids)
    assert torch.equal(out[:, :, 10:13], out2[:, :, 10:13])
    assert not torch.equal(out[:, :, :10], out2[:, :, :10])
    # and a later key of the same document does not reach an earlier query
    k3 = k.clone()
    k3[:, :, 12] += 10
    out3 = document_attention(q, k3, v, ids)
    assert torch.equal(out[:, :, 10:12], out3[:, :, 10:12])


def test_one_document_per_row_is_causal_sdpa():
    q, k, v = _qkv(2, 4, 2)
    ids = _ids([[T], [T]])
    got = document_attention(q, k, v, ids)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    exact = F.scaled_dot_product_attention(
        q.double(),
        k.double().repeat_interleave(2, 1),
        v.double().repeat_interleave(2, 1),
        is_causal=True,
    )
    tolerance.assert_agree(got, want, exact, length=max(T, D), dtype=torch.float32)


def test_scale_and_errors():
    q, k, v = _qkv(1, 2, 2)
    ids = _ids([[8, 24]])
    tolerance.assert_agree(
        document_attention(q, k, v, ids, scale=0.3),
        dense_document_attention(q, k, v, ids, scale=0.3),
        dense_document_attention(q.double(), k.double(), v.double(), ids, scale=0.3),
        length=T,
    )
    with pytest.raises(ValueError, match="non-decreasing"):
        document_attention(q, k, v, ids.flip(1))
    with pytest.raises(ValueError, match="doc_ids"):
        document_attention(q, k, v, ids[:, :5])


def _brute_work(layouts, seq, cp):
    counts = [0] * cp
    for lens in layouts:
        ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        mask = (ids[:, None] == ids[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
        for r in range(cp):
            counts[r] += int(mask[local_positions(seq, cp, r)].sum())
    return counts


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_causal_work_matches_brute_force(cp):
    seq = 64
    g = torch.Generator().manual_seed(cp)
    layouts = [[seq], [1] * seq, [5, 20, 1, 38]]
    for _ in range(3):
        cuts = sorted(set(torch.randint(1, seq, (6,), generator=g).tolist()))
        edges = [0, *cuts, seq]
        layouts.append(list(np.diff(edges).tolist()))
    got = causal_work(layouts, seq, cp)
    assert got == _brute_work(layouts, seq, cp)
    assert sum(got) == sum(sum(n * (n + 1) // 2 for n in lens) for lens in layouts)
    # one causal document per row is balanced by the layout; so is every layout at cp=1
    assert work_balance(causal_work([[seq]], seq, cp)) == 1.0
    with pytest.raises(ValueError):
        causal_work([[seq - 1]], seq, cp)
