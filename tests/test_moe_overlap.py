"""The overlapped MoE layer (K = 2, 4 chunks) equals the plain layer (K = 1): outputs and every
gradient, EP = 2 and 4, capacity and dropless (uneven token counts), with the C++ extension's
all-to-all and with torch.distributed's; the chunked path on one rank for both expert kinds
(GELU MLP and gated SwiGLU; tests/test_moe_gated.py checks the gated experts under EP and
overlap against a per-token reference).

Not bit for bit: every row goes through the same expert math, but BLAS may block a chunk of M
rows otherwise than the whole buffer, and the weight gradients are summed chunk by chunk. So
each quantity is judged by ``fastpar.tolerance``'s rule (docs/tolerances.md): its error against
the plain layer's float64 copy at most 4 x the plain fp32 layer's own plus a floor."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh
from _parity import agree, exact_copy

from fastpar.moe import MoE, overlap
from fastpar.testing import RankError, RankTimeout, run_ranks

TRANSPORTS = ["python"] + (["extension"] if overlap._extension_ops() else [])


def _compare(capacity_factor, transport: str) -> dict:
    os.environ["FASTPAR_MOE_TRANSPORT"] = transport
    rank, ep = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(ep=ep)
    # dropless: every rank routes a different number of tokens, skewed towards some experts;
    # capacity mode needs the same token count on every EP rank (static all-to-all splits)
    tokens = 6 + 5 * rank if capacity_factor is None else 12
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(rank))
    x[: tokens // 2] += 3.0
    g = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(100 + rank))
    layers = {}
    for k in (1, 2, 4):
        torch.manual_seed(0)
        layers[k] = MoE(
            16, 24, 8, top_k=2, capacity_factor=capacity_factor, overlap_chunks=k, mesh=mesh
        )
    layers["exact"] = exact_copy(layers[1])  # the plain layer in float64: the exact math
    names = ["output", "input grad", *[f"grad {n}" for n, _ in layers[1].named_parameters()]]
    results = {}
    for k, moe in layers.items():
        dtype = moe.w1.dtype
        xi = x.to(dtype, copy=True).requires_grad_()
        y = moe(xi)
        (y * g.to(dtype)).sum().backward()
        results[k] = [y.detach(), xi.grad, *[p.grad for p in moe.parameters()]]
    # the rows an expert's gradient can sum over (every rank's tokens, 2 choices each), the FFN
    rows = 2 * (sum(6 + 5 * r for r in range(ep)) if capacity_factor is None else 12 * ep)
    worst = 0.0
    for k in (2, 4):
        for what, a, b, e in zip(names, results[k], results[1], results["exact"], strict=True):
            worst = max(worst, agree(a, b, e, f"K={k}: {what}", length=max(rows, 24)).ratio)
    return {"worst_ratio": worst}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
@pytest.mark.parametrize("ep", [2, 4])
def test_overlapped_equals_plain(ep, capacity_factor, transport):
    out = run_ranks(_compare, ep, capacity_factor, transport)
    assert all(o["worst_ratio"] <= 1 for o in out)


def _error_mid_overlap(transport: str) -> None:
    os.environ["FASTPAR_MOE_TRANSPORT"] = transport
    mesh = make_mesh(ep=2)
    torch.manual_seed(0)
    moe = MoE(8, 8, 4, top_k=1, capacity_factor=1.0, overlap_chunks=2, mesh=mesh)
    if dist.get_rank() == 1:

        def boom(x):
            raise FloatingPointError("expert compute failed on rank 1")

        moe._experts_batched = boom
    moe(torch.randn(10, 8))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_error_on_one_rank_reaches_the_caller_without_a_hang(transport):
    with pytest.raises(RankError) as info:
        run_ranks(_error_mid_overlap, 2, transport, timeout=60)
    assert not isinstance(info.value, RankTimeout)
    assert "expert compute failed on rank 1" in str(info.value)


def test_bad_overlap_chunks():
    with pytest.raises(ValueError, match="overlap_chunks must be a positive integer, got 0"):
        MoE(8, 8, 4, overlap_chunks=0)


def test_chunk_sizes_cover_the_rows_and_taper_the_ends():
    from fastpar.moe.overlap import _split

    for n in range(0, 40):
        for k in range(1, 9):
            sizes = _split(n, k)
            assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 0, (n, k, sizes)
    assert _split(512, 2) == [256, 256]
    # k >= 3: first and last chunks half the middle ones, leftovers on the middle
    assert _split(512, 4) == [85, 171, 171, 85]
    assert _split(12, 3) == [3, 6, 3]
    assert _split(100, 8) == [7, 15, 15, 14, 14, 14, 14, 7]


def _overlap_on_one_rank(transport: str, device: str, expert: str) -> float:
    """One rank (the all-to-all is a copy to itself): the chunked path with its pack / unpack
    ops, async collectives and, on a GPU, NCCL's stream ordered by events, against the experts
    called directly (fp32, and float64 for the rule). Outputs and every gradient; returns the
    worst error / bound."""
    os.environ["FASTPAR_MOE_TRANSPORT"] = transport
    torch.manual_seed(0)
    e, c, h = 4, 12, 16
    moe = MoE(h, 24, e, top_k=1, capacity_factor=1.0, expert=expert).to(device)
    moe64 = exact_copy(moe)
    params = moe._expert_params()
    permuted = torch.randn(e, c, h, device=device, requires_grad=True)
    grad_out = torch.randn(e, c, h, device=device)
    want = moe._experts_batched(permuted)
    want_grads = torch.autograd.grad(want, [permuted, *params], grad_out)
    p64 = permuted.detach().double().requires_grad_()
    exact = moe64._experts_batched(p64)
    exact_grads = torch.autograd.grad(exact, [p64, *moe64._expert_params()], grad_out.double())
    names = [
        "input grad",
        *[f"grad {n}" for n in ("w1", "b1", "w2", "b2") if getattr(moe, n) is not None],
    ]
    worst = 0.0
    for k in (1, 2, 4):
        chunks = overlap.CapacityChunks(e, c, h, 1, k)
        y = overlap.OverlappedExperts.apply(
            permuted, chunks, lambda x, j: moe._experts_batched(x), dist.group.WORLD, *params
        )
        grads = torch.autograd.grad(y, [permuted, *params], grad_out)
        n = max(c, 2 * 24)  # the rows a weight gradient sums over, the widths
        results = [agree(y, want, exact, f"K={k}: output", length=n)]
        for what, a, b, x in zip(names, grads, want_grads, exact_grads, strict=True):
            results.append(agree(a, b, x, f"K={k}: {what}", length=n))
        worst = max([worst, *(r.ratio for r in results)])
    return worst


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_chunked_path_on_one_rank_equals_the_experts(transport, expert):
    assert run_ranks(_overlap_on_one_rank, 1, transport, "cpu", expert)[0] <= 1


@pytest.mark.cuda
@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_chunked_path_on_one_gpu_equals_the_experts(transport, expert):
    out = run_ranks(
        _overlap_on_one_rank, 1, transport, "cuda", expert, backend="nccl", start_method="spawn"
    )
    assert out[0] <= 1
