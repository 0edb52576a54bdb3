"""Ring attention with packed documents (``fastpar.parallel.context.ring_attention(...,
doc_ids=)``) beside plain causal ring attention, on CPU ranks over gloo: cp = 2, one row of
S = 4096 tokens (B=1, H=4, D=64, fp32; chunks of 1024), 8 and 64 documents at random cuts
(seeded), one thread per rank:

* forward + backward step time (median over the ranks of each rank's median), and as a ratio
  of plain causal ring attention's;
* the (query chunk, key chunk) blocks per rank and forward (``measure_waits``): total (what
  causal attention computes), skipped (no query sees a key of the block) and masked (run with
  a document mask), summed over the ranks.

Run:  pytest bench/test_bench_ring_documents.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.parallel.context import measure_waits, ring_attention
from fastpar.testing import run_ranks

B, H, D, S, CP = 1, 4, 64, 4096, 2
ITERS = 3


def _doc_ids(docs: int) -> torch.Tensor | None:
    """[1, S]: ``docs`` documents at random cut points (seed 0), or None (plain causal)."""
    if not docs:
        return None
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(S - 1, generator=g)[: docs - 1] + 1
    starts = torch.zeros(S, dtype=torch.long)
    starts[cuts] = 1
    return starts.cumsum(0)[None]


def _steps(docs: int) -> dict:
    ids = _doc_ids(docs)
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(B, H, S // CP, D, generator=g).requires_grad_() for _ in range(3))

    def step():
        out = ring_attention(q, k, v, doc_ids=ids)
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None

    step()  # warm-up (connections, allocator)
    times = []
    for _ in range(ITERS):
        dist.barrier()
        t0 = time.perf_counter()
        with measure_waits() as stats:
            step()
        times.append(time.perf_counter() - t0)
    blocks = {key: stats[key] for key in ("blocks_total", "blocks_skipped", "blocks_masked")}
    return {"step_s": statistics.median(times), **blocks}


@pytest.mark.parametrize("docs", [0, 8, 64], ids=["causal", "docs8", "docs64"])
def test_ring_attention_documents(benchmark, docs):
    benchmark.group = f"ring-attention-documents-S{S}-cp{CP}"
    res = benchmark.pedantic(
        run_ranks, args=(_steps, CP, docs), kwargs=dict(threads_per_rank=1), rounds=1, iterations=1
    )
    step = statistics.median(r["step_s"] for r in res)
    total, skipped, masked = (
        sum(r[key] for r in res) for key in ("blocks_total", "blocks_skipped", "blocks_masked")
    )
    ids = _doc_ids(docs)
    # documents that cross a chunk boundary (of 2·cp chunks), for the report
    c = S // (2 * CP)
    crossing = (
        0 if ids is None else sum(int(ids[0, i * c - 1] == ids[0, i * c]) for i in range(1, 2 * CP))
    )
    info = dict(
        cp=CP,
        seq_len=S,
        docs=docs,
        step_seconds=step,
        blocks_total=total,
        blocks_skipped=skipped,
        blocks_masked=masked,
        documents_crossing_chunk_boundaries=crossing,
    )
    fn = test_ring_attention_documents
    if not docs:
        fn.base = step
    elif getattr(fn, "base", None):
        info["over_causal_ring"] = step / fn.base
    benchmark.extra_info.update(info)
    ratio = f" ({info['over_causal_ring']:.2f}x causal ring)" if "over_causal_ring" in info else ""
    print(
        f"\nring attention S={S} cp={CP} docs={docs or 'none (causal)'}: fwd+bwd "
        f"{step * 1e3:.1f} ms{ratio}; blocks skipped {skipped}/{total}, masked {masked}; "
        f"{crossing} of {2 * CP - 1} chunk boundaries inside a document"
    )
    for r in res:
        assert r["blocks_total"] == 2 * CP + 1
    if docs:
        assert masked >= 2 * CP  # at least every rank's diagonal blocks
