"""Attention that stops at documents (``fastpar.ops.documents``) beside full causal SDPA, on one
packed row of S = 4096 tokens (B=1, H=4, D=64, fp32, CPU), 8 and 64 equal-ish documents:

* forward + backward time, and as a ratio of full causal SDPA's;
* peak CPU bytes of forward + backward from the profiler's allocation events
  (``_common.cpu_peak_and_held``), beside the S² bytes of the dense boolean mask that
  ``dense_document_attention`` (the reference) would build;
* the context-parallel work balance (max / mean of the (query, key) pairs per rank,
  ``causal_work``) at cp = 2 and 4 for lognormal document lengths of mean 512 packed into S.

Run:  pytest bench/test_bench_documents.py -s --benchmark-json=...
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _common import cpu_peak_and_held

from fastpar.ops.documents import causal_work, document_attention, work_balance

B, H, D, S = 1, 4, 64, 4096
ROUNDS = 3


def _equalish(n_docs: int) -> torch.Tensor:
    edges = np.linspace(0, S, n_docs + 1).round().astype(int)
    lens = torch.tensor(np.diff(edges))
    return torch.repeat_interleave(torch.arange(n_docs), lens)[None]


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("docs", [0, 8, 64], ids=["causal-sdpa", "docs8", "docs64"])
def test_document_attention(benchmark, docs):
    benchmark.group = f"document-attention-S{S}"
    q, k, v = _qkv()
    ids = _equalish(max(docs, 1))

    def step():
        if docs:
            out = document_attention(q, k, v, ids)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None

    step()  # warm-up
    peak, _ = cpu_peak_and_held(step)
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    median = benchmark.stats.stats.median
    fn = test_document_attention
    info = dict(docs=docs, seq_len=S, peak_bytes=peak, dense_mask_bytes=B * S * S)
    if not docs:
        fn.base = (median, peak)
    base = getattr(fn, "base", None)
    if docs and base:
        info.update(time_over_causal=median / base[0], peak_over_causal=peak / base[1])
    benchmark.extra_info.update(info)
    print(
        f"\n{'causal SDPA' if not docs else f'{docs} documents'} S={S}: fwd+bwd "
        f"{median * 1e3:.1f} ms"
        + (f" ({median / base[0]:.2f}x causal SDPA)" if docs and base else "")
        + f", peak {peak / 2**20:.1f} MiB"
        + (f" ({peak / base[1]:.2f}x)" if docs and base else "")
        + f"; a dense mask alone would be {B * S * S / 2**20:.0f} MiB (bool), its fp32 scores "
        f"{B * H * S * S * 4 / 2**20:.0f} MiB"
    )


def _lognormal_rows(rows: int = 16, mean: float = 512.0, sigma: float = 1.0, seed: int = 0):
    """Rows of S tokens packed with lognormal document lengths of mean ``mean`` (the last one
    cut at the row's end)."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma**2 / 2
    out = []
    for _ in range(rows):
        lens, left = [], S
        while left:
            n = int(min(left, max(1, round(rng.lognormal(mu, sigma)))))
            lens.append(n)
            left -= n
        out.append(lens)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_balance(benchmark, cp):
    benchmark.group = "document-cp-balance"
    rows = _lognormal_rows()
    counts = benchmark.pedantic(causal_work, args=(rows, S, cp), rounds=1, iterations=1)
    per_row = [work_balance(causal_work([r], S, cp)) for r in rows]
    bal = work_balance(counts)
    benchmark.extra_info.update(
        cp=cp,
        counts=counts,
        balance=bal,
        worst_row_balance=max(per_row),
        mean_docs_per_row=float(np.mean([len(r) for r in rows])),
    )
    print(
        f"\ncp={cp}, {len(rows)} rows of lognormal documents (mean 512, sigma 1) in S={S}: "
        f"work max/mean {bal:.3f} over the batch, per row median "
        f"{float(np.median(per_row)):.3f}, worst {max(per_row):.3f}"
    )
