"""MoE at TP = 2 (``fastpar.moe.tp``): expert tensor parallelism and sequence parallelism, with
and without expert parallelism (TP2 × EP1 on 2 ranks, TP2 × EP2 on 4), against the
single-process layer holding every expert in full: outputs, the aux loss, the input gradient
and every parameter gradient on every rank (sharded ones against their slice), for SwiGLU and
biased GeGLU experts, shared experts with a gate, softmax and DeepSeek-style routing (sigmoid,
group-limited, expert bias), micro-batch and sequence aux losses with a z-loss. Replicated
parameters (router, ``b2``, shared experts) must also agree across the TP ranks that hold
copies; expert-bias counts are summed over TP under sequence parallelism.

Each quantity is judged by ``fastpar.tolerance``'s rule (docs/tolerances.md): its error against
the single-process layer's float64 copy at most 4 x the fp32 single-process layer's own plus a
floor. The fp32 and float64 layers must route alike (checked: a near-tie fails as that)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _flags import DEEPSEEK_STYLE, tiny_config
from _mesh import make_mesh
from _parity import agree, exact_copy

from fastpar.moe import MoE, update_expert_bias
from fastpar.nn.marks import param_layout
from fastpar.testing import run_ranks

H, FFN, E, K, B, S = 8, 8, 4, 2, 2, 6

ROUTINGS = {
    "softmax": dict(aux_loss="micro_batch", z_loss_coef=0.1),
    "deepseek": dict(
        score="sigmoid",
        num_groups=2,
        group_topk=1,
        expert_bias=True,
        scaling_factor=2.0,
        aux_loss="sequence",
        z_loss_coef=0.05,
    ),
}
EXPERTS = {
    "swiglu-shared": dict(expert="swiglu", shared_ffn_hidden_size=6, shared_gate=True),
    "geglu-bias": dict(expert="glu", activation="gelu", bias=True),
}


def _layer(mesh, routing, kind, capacity, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(
        H,
        FFN,
        E,
        K,
        capacity_factor=capacity,
        min_capacity=None,
        aux_loss_coef=0.3,
        mesh=mesh,
        **ROUTINGS[routing],
        **EXPERTS[kind],
        **kw,
    )
    if moe.router.expert_bias is not None:  # a bias that changes the choice
        moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return moe


def _batch(dp_rank: int):
    g = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.randn(B, S, H, generator=g)
    x[:, : S // 2] += 1.0
    return x, torch.randn(B, S, H, generator=g)


def _grads(moe, x, g):
    moe.zero_grad(set_to_none=True)
    dtype = moe.w1.dtype
    x = x.to(dtype, copy=True).requires_grad_()
    y = moe(x)
    (y * g.to(dtype)).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return y.detach(), moe.aux_loss.detach().clone(), x.grad, grads


def _routes(moe, x) -> torch.Tensor:
    """The experts each token of ``x`` [B, S, H] is sent to (-1 where dropped)."""
    from fastpar.ops.moe_permute import moe_permute

    with torch.no_grad():
        t = x.reshape(-1, H).to(moe.w1.dtype)
        r = moe.router(t, seq_len=x.shape[1])
        _, info = moe_permute(t, r.expert_ids, E, r.capacity, r.order)
    return torch.where(info.slots >= 0, r.expert_ids, -1)


def _local(full: torch.Tensor, p: torch.Tensor, mesh, name: str, moe: MoE) -> torch.Tensor:
    """This rank's part of the reference tensor ``full`` laid out like parameter ``p``."""
    if name in ("w1", "b1", "w2", "b2"):
        full = full[mesh.ep_rank * moe.num_local : (mesh.ep_rank + 1) * moe.num_local]
    layout = param_layout(p)
    if layout is not None and layout.kind == "sharded":
        halves = full.chunk(layout.fused, layout.dim)
        full = torch.cat(
            [h.chunk(mesh.tp_size, layout.dim)[mesh.tp_rank] for h in halves], layout.dim
        )
    return full


def _check(routing, kind, layout, ep, capacity):
    mesh = make_mesh(tp=2, ep=ep)
    sp = layout in ("sp", "sp+etp")
    moe = _layer(
        mesh, routing, kind, capacity, sequence_parallel=sp, expert_tp=layout in ("etp", "sp+etp")
    )
    ref = _layer(None, routing, kind, capacity)
    ref64 = exact_copy(ref)
    batches = [_batch(r) for r in range(mesh.dp_size)]
    for b in batches:  # the premise of comparing with float64: the same routing
        assert torch.equal(_routes(ref, b[0]), _routes(ref64, b[0])), "a near-tie of scores"
    refs = [_grads(ref, *b) for b in batches]
    refs64 = [_grads(ref64, *b) for b in batches]
    x, g = _batch(mesh.dp_rank)
    chunk = slice(mesh.tp_rank * S // 2, (mesh.tp_rank + 1) * S // 2) if sp else slice(None)
    y, aux, x_grad, grads = _grads(moe, x[:, chunk], g[:, chunk])
    (y_ref, aux_ref, dx_ref, grads_ref), exact = refs[mesh.dp_rank], refs64[mesh.dp_rank]
    n = max(B * S * mesh.dp_size, H, FFN)  # the tokens an expert's gradient sums over
    agree(y, y_ref[:, chunk], exact[0][:, chunk], "output", length=n)
    agree(aux, aux_ref, exact[1], "aux loss", length=n)
    agree(x_grad, dx_ref[:, chunk], exact[2][:, chunk], "dx", length=n)
    assert set(grads) == set(grads_ref)
    for name, p in moe.named_parameters():
        routed = name in ("w1", "b1", "w2", "b2")
        # an expert's gradient sums every EP rank's tokens (each rank's routes reach it)
        want, want64 = (
            (sum(r[3][name] for r in rs) if routed and ep > 1 else rs[mesh.dp_rank][3][name])
            for rs in (refs, refs64)
        )
        want, want64 = (_local(w, p, mesh, name, moe) for w in (want, want64))
        assert grads[name].shape == want.shape, name
        agree(grads[name], want, want64, name, length=n)
        if param_layout(p) is None or param_layout(p).kind != "sharded":  # copies agree
            every = [torch.empty_like(grads[name]) for _ in range(2)]
            dist.all_gather(every, grads[name], group=mesh.tp_group)
            # bit for bit: each TP rank computes a replicated parameter's gradient from the
            # same numbers with the same kernels (or receives one all-reduced sum)
            assert torch.equal(every[0], every[1]), f"{name}: TP copies' gradients differ"
    if moe.router.expert_bias is not None:  # the bias update sees every TP rank's tokens
        ref_counts = sum(ref_moe_counts(routing, kind, capacity, r) for r in range(mesh.dp_size))
        update_expert_bias(moe, mesh.dp_group)
        # +-1e-3 steps from integer counts: one rounding each side, no reduction to reorder
        torch.testing.assert_close(moe.router.expert_bias, _bias_after(ref_counts))
    return float(aux)


def ref_moe_counts(routing, kind, capacity, dp_rank) -> torch.Tensor:
    ref = _layer(None, routing, kind, capacity)
    x, g = _batch(dp_rank)
    (ref(x) * g).sum().backward()
    return ref.router.tokens_per_expert.clone()


def _bias_after(counts: torch.Tensor) -> torch.Tensor:
    bias = torch.tensor([0.3, -0.2, 0.1, 0.0])
    load = counts.float()
    return bias + 1e-3 * torch.sign(load.mean() - load)


CASES = [
    ("softmax", "swiglu-shared", "etp", 1, None),
    ("softmax", "geglu-bias", "etp", 1, 2.0),
    ("deepseek", "swiglu-shared", "sp", 1, None),
    ("softmax", "geglu-bias", "sp", 1, None),
    ("deepseek", "geglu-bias", "sp+etp", 1, None),
    ("softmax", "swiglu-shared", "sp+etp", 1, 1.0),
    ("deepseek", "swiglu-shared", "etp", 2, None),
    ("softmax", "geglu-bias", "etp", 2, 2.0),
    ("softmax", "swiglu-shared", "sp", 2, None),
    ("deepseek", "geglu-bias", "sp", 2, None),
    ("softmax", "geglu-bias", "sp+etp", 2, None),
    ("deepseek", "swiglu-shared", "sp+etp", 2, 1.5),
]


@pytest.mark.parametrize("routing,kind,layout,ep,capacity", CASES)
def test_tp2_equals_the_single_process_layer(routing, kind, layout, ep, capacity):
    world = 2 * ep
    out = run_ranks(_check, world, routing, kind, layout, ep, capacity)
    assert all(a > 0 for a in out)


def _errors():
    mesh = make_mesh(tp=2)
    msgs = []
    for kw in (
        dict(sequence_parallel=True, capacity_factor=1.25),
        dict(expert_tp=True, capacity_factor=None, ffn=7),
        dict(expert_tp=True, capacity_factor=None, overlap_chunks=2),
    ):
        ffn = kw.pop("ffn", FFN)
        try:
            MoE(H, ffn, E, K, mesh=mesh, **kw)
        except ValueError as e:
            msgs.append(str(e))
    moe = MoE(
        H, FFN, E, K, mesh=mesh, sequence_parallel=True, capacity_factor=None, aux_loss="sequence"
    )
    try:
        moe(torch.randn(6, H))
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_clear_errors_for_what_a_tp_layout_cannot_do():
    msgs = run_ranks(_errors, 2)[0]
    assert len(msgs) == 4
    assert "capacity_factor=1.25" in msgs[0] and "capacity_factor=None" in msgs[0]
    assert "ffn_hidden_size 7" in msgs[1] and "multiple of 2" in msgs[1]
    assert "overlap_chunks" in msgs[2]
    assert "batch-first" in msgs[3] and "(6, 8)" in msgs[3]


DEEPSEEK_FLAGS = DEEPSEEK_STYLE
SMALL = tiny_config(steps=3, pp=1)


@pytest.mark.parametrize(
    "model,sp,expert_tp,zero",
    [("llama", True, True, 2), ("gpt", True, False, 2)],  # more: tests/test_verify_matrix.py
    ids=["llama-sp-etp-z2", "gpt-sp-z2"],
)
def test_verify_deepseek_style_moe_at_dp2_ep2_tp2(model, sp, expert_tp, zero):
    """``fastpar.verify``: the trainer at DP2 x EP2 x TP2 with DeepSeek-style MoE blocks
    (sigmoid, group-limited, expert bias, shared expert, sequence aux loss, z-loss) equals the
    single-process model: losses, grad norms, every parameter and expert bias after 3 steps."""
    from fastpar.train import TrainConfig
    from fastpar.verify import compare

    cfg = TrainConfig.from_flags(
        **SMALL,
        **DEEPSEEK_FLAGS,
        model_type=model,
        tp=2,
        dp=2,
        ep=2,
        zero=zero,
        moe_every=2,
        sequence_parallel=sp,
        moe_expert_tp=expert_tp,
    )
    ok, text = compare(cfg)
    assert ok, text


def test_sequence_parallel_moe_with_capacity_is_refused_by_the_model():
    from fastpar.train import TrainConfig

    cfg = TrainConfig.from_flags(
        **SMALL, tp=2, dp=1, ep=1, moe_every=2, sequence_parallel=True, capacity_factor=1.25
    )
    with pytest.raises(ValueError, match=r"capacity_factor=1\.25 would drop per chunk"):
        cfg.check()
