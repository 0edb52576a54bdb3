"""The MoE layer's experts, gated SwiGLU (``expert="swiglu"``) and the default GELU MLP, against
a pure-torch reference written token by token (softmax router, top-k, capacity drops by the
stated policy, renormalised weights, load-balancing and z-loss): outputs, the aux loss, the
input gradient, the router gradient and every expert gradient, at EP 1, 2 and 4, capacity and
dropless, plain and overlapped in K chunks (both all-to-all transports).

Judged by ``fastpar.tolerance``'s rule (docs/tolerances.md): the layer's error against the
reference run in float64 at most 4 x the same reference's own error in fp32 plus a floor. The
fp32 and float64 references route alike (the same experts, the same drops: checked), so a
near-tie of two scores fails as that rather than as a large error."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _parity import agree

from fastpar.moe import MoE, overlap
from fastpar.testing import run_ranks

H, FFN, E = 12, 10, 8
TRANSPORTS = ["python"] + (["extension"] if overlap._extension_ops() else [])
MODES = {  # router options of each case
    "capacity": dict(capacity_factor=1.0, top_k=2, drop_policy="position"),
    "probs": dict(capacity_factor=0.5, top_k=1, drop_policy="probs"),
    "dropless": dict(capacity_factor=None, top_k=2),
    "dropless-raw": dict(capacity_factor=None, top_k=3, normalize_topk=False),  # Qwen3-MoE
}


def _expert(kind: str, w: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` on one token x [H], from nn.Linear-layout weights."""
    if kind == "swiglu":
        return (F.silu(w["gate"][e] @ x) * (w["up"][e] @ x)) @ w["down"][e].t()
    return w["w2"][e] @ F.gelu(w["w1"][e] @ x + w["b1"][e]) + w["b2"][e]


def reference_moe(
    x,
    w,
    kind,
    *,
    top_k,
    capacity_factor,
    drop_policy="position",
    normalize_topk=None,
    min_capacity=2,
    aux_loss_coef=0.0,
    z_loss_coef=0.0,
):
    """y [T, H], the aux loss and the routing (chosen experts, -1 where dropped) of a MoE layer,
    one token at a time, in ``x``'s dtype. ``w``: "router" [E, H] and the experts' weights in
    nn.Linear layouts (see ``_weights``). ``normalize_topk`` None: renormalise when top_k > 1
    (Switch keeps the raw top-1 probability)."""
    t = x.shape[0]
    normalize_topk = top_k > 1 if normalize_topk is None else normalize_topk
    logits = x @ w["router"].t()
    probs = torch.softmax(logits, dim=-1)
    top, ids = probs.topk(top_k, dim=-1)
    kept = [[True] * top_k for _ in range(t)]
    if capacity_factor is not None:
        capacity = max(min_capacity, math.ceil(top_k * t / E * capacity_factor))
        pairs = [(j, i) for j in range(top_k) for i in range(t)]  # every first choice first
        if drop_policy == "probs":  # most probable first (sort is stable)
            pairs.sort(key=lambda p: -top[p[1], p[0]].item())
        used = [0] * E
        for j, i in pairs:
            e = int(ids[i, j])
            kept[i][j] = used[e] < capacity
            used[e] += kept[i][j]
    rows = []
    for i in range(t):
        weights = [top[i, j] if kept[i][j] else top[i, j] * 0 for j in range(top_k)]
        total = sum(weights)
        if normalize_topk and float(total) > 0:
            weights = [v / total for v in weights]
        row = x.new_zeros(H)
        for j in range(top_k):
            if kept[i][j]:
                row = row + weights[j] * _expert(kind, w, int(ids[i, j]), x[i])
        rows.append(row)
    counts = torch.bincount(ids.flatten(), minlength=E).to(x.dtype)
    balance = aux_loss_coef * E * ((counts / (t * top_k)) * probs.mean(0)).sum()
    z = z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
    routes = torch.where(torch.tensor(kept), ids, -1)
    return torch.stack(rows), balance + z, routes


def _weights(moe: MoE, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The single-process layer's weights as independent leaves in nn.Linear layouts, in
    ``dtype``."""
    f = moe.ffn_hidden_size
    w1, w2 = moe.w1.detach().transpose(1, 2), moe.w2.detach().transpose(1, 2)
    if moe.expert == "swiglu":
        parts = {"gate": w1[:, :f], "up": w1[:, f:], "down": w2}
    else:
        parts = {"w1": w1, "b1": moe.b1.detach(), "w2": w2, "b2": moe.b2.detach()}
    parts["router"] = moe.router.weight.detach()
    return {k: v.to(dtype, copy=True).requires_grad_() for k, v in parts.items()}


def _layer_grads(w: dict, kind: str) -> dict[str, torch.Tensor]:
    """The reference's expert gradients in the layer's parameter layouts."""
    if kind == "swiglu":
        w1 = torch.cat([w["gate"].grad, w["up"].grad], dim=1)
        return {"w1": w1.transpose(1, 2), "w2": w["down"].grad.transpose(1, 2)}
    return {
        "w1": w["w1"].grad.transpose(1, 2),
        "b1": w["b1"].grad,
        "w2": w["w2"].grad.transpose(1, 2),
        "b2": w["b2"].grad,
    }


def _inputs(ep: int, dropless: bool):
    """Each rank's tokens (dropless: a different count on every rank) skewed towards some
    experts, and the output gradients."""
    xs, gs = [], []
    for r in range(ep):
        t = 9 + 4 * r if dropless else 16
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(10 + r))
        x[: t // 2] += 2.0
        xs.append(x)
        gs.append(torch.randn(t, H, generator=torch.Generator().manual_seed(20 + r)))
    return xs, gs


def _parity(kind: str, mode: str, overlap_chunks: int, transport: str) -> int:
    os.environ["FASTPAR_MOE_TRANSPORT"] = transport
    ep, rank = dist.get_world_size(), dist.get_rank()
    opts = dict(MODES[mode], min_capacity=2, aux_loss_coef=0.05, z_loss_coef=1e-3)
    torch.manual_seed(0)
    full = MoE(H, FFN, E, expert=kind, **opts)
    torch.manual_seed(0)
    moe = MoE(H, FFN, E, expert=kind, overlap_chunks=overlap_chunks, mesh=make_mesh(ep=ep), **opts)
    lo, n_local = rank * moe.num_local, moe.num_local
    names = [name for name, _ in moe.named_parameters() if name != "router.weight"]
    assert names == (["w1", "w2"] if kind == "swiglu" else ["w1", "b1", "w2", "b2"])
    for name in names:  # the full weights drawn at every EP size, then this rank's experts:
        # a slice of the same initialisation, bit for bit
        assert torch.equal(getattr(moe, name), getattr(full, name)[lo : lo + n_local]), name
    assert torch.equal(moe.router.weight, full.router.weight)

    xs, gs = _inputs(ep, MODES[mode]["capacity_factor"] is None)
    ref_opts = {k: v for k, v in opts.items() if k not in ("min_capacity",)}
    want = {}  # the reference in fp32 (the single-process run) and float64 (the exact math)
    for dtype in (torch.float32, torch.float64):
        w, runs = _weights(full, dtype), []
        for x, g in zip(xs, gs, strict=True):  # every rank's tokens reach every expert
            x = x.to(dtype, copy=True).requires_grad_()
            y, aux, routes = reference_moe(x, w, kind, min_capacity=2, **ref_opts)
            router_before = 0 if w["router"].grad is None else w["router"].grad.clone()
            ((y * g.to(dtype)).sum() + aux).backward()
            router_grad = w["router"].grad - router_before
            runs.append((y.detach(), aux.detach(), x.grad, router_grad, routes))
        want[dtype] = runs, _layer_grads(w, kind)
    (single, grads32), (exact, grads64) = want[torch.float32], want[torch.float64]
    for a, b in zip(single, exact, strict=True):
        assert torch.equal(a[4], b[4]), "fp32 and float64 route differently: a near-tie"

    x = xs[rank].clone().requires_grad_()
    y = moe(x)
    ((y * gs[rank]).sum() + moe.aux_loss).backward()
    n = max(sum(t.shape[0] for t in xs), FFN, H)  # the tokens an expert's gradient sums over
    for i, (what, got) in enumerate(
        (
            ("output", y),
            ("aux loss", moe.aux_loss),
            ("input grad", x.grad),
            ("router grad", moe.router.weight.grad),
        )
    ):
        agree(got, single[rank][i], exact[rank][i], what, length=n)
    for name, g in grads32.items():
        sl = slice(lo, lo + n_local)
        agree(getattr(moe, name).grad, g[sl], grads64[name][sl], f"expert grad {name}", length=n)
    return int(moe.stats["num_dropped"])


CASES = [("swiglu", m, 1, "python", ep) for ep in (1, 2, 4) for m in MODES]
CASES += [
    ("swiglu", m, 3, t, ep) for ep in (2, 4) for m in ("capacity", "dropless") for t in TRANSPORTS
]
CASES += [("mlp", m, k, "python", 2) for m in ("capacity", "dropless") for k in (1, 3)]


@pytest.mark.parametrize(
    "kind,mode,overlap_chunks,transport,ep",
    CASES,
    ids=[f"{c[0]}-{c[1]}-k{c[2]}-{c[3]}-ep{c[4]}" for c in CASES],
)
def test_experts_equal_the_per_token_reference(kind, mode, overlap_chunks, transport, ep):
    dropped = run_ranks(_parity, ep, kind, mode, overlap_chunks, transport)
    if MODES[mode]["capacity_factor"] is not None:  # the capacity cases really drop tokens
        assert sum(dropped) > 0
    else:
        assert sum(dropped) == 0


def test_gated_experts_are_bias_free_and_drawn_like_linear_layers():
    torch.manual_seed(0)
    moe = MoE(16, 24, 4, expert="swiglu")
    assert dict((n, tuple(p.shape)) for n, p in moe.named_parameters()) == {
        "router.weight": (4, 16),
        "w1": (4, 16, 48),  # gate | up
        "w2": (4, 24, 16),
    }
    assert moe.b1 is None and moe.b2 is None and moe.activation == "silu"
    # nn.Linear's Kaiming-uniform bound 1 / sqrt(fan_in), and the whole range used
    for w, fan_in in ((moe.w1, 16), (moe.w2, 24)):
        bound = 1 / math.sqrt(fan_in)
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert "expert=swiglu" in repr(moe)


def test_expert_argument_errors():
    with pytest.raises(ValueError, match=r"expert must be one of \('mlp', 'swiglu'\), got 'geglu'"):
        MoE(8, 8, 4, expert="geglu")
    with pytest.raises(ValueError, match="activation='gelu' does not apply to them"):
        MoE(8, 8, 4, expert="swiglu", activation="gelu")
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(8, 8, 4, activation="tanh")
    MoE(8, 8, 4, expert="swiglu", activation="silu")  # the one it is: accepted
