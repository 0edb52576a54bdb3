"""MoE: router semantics on hand-built logits; expert parallelism (EP = 1, 2, 4; 4 and 8 experts)
against the single-process layer holding every expert; a small MoE transformer under DP x EP
trained like the single-process model.

Parallel against single-process results are judged by ``fastpar.tolerance``'s rule
(docs/tolerances.md): each quantity's error against the same math in float64 (the layer's
``.double()`` copy) at most 4 x the fp32 single-process run's own plus a floor. Routing is
discrete: the fp32 and float64 references must pick the same experts and drop the same choices
(``same_routing`` of tests/_parity.py), so a near-tie shows as that, not as a large error."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _parity import agree, agree_ep, ep_run, exact_copy
from torch import nn

from fastpar.moe import MoE, TopKRouter, capacity_for, moe_aux_loss
from fastpar.ops.moe_permute import moe_permute
from fastpar.parallel import DistributedDataParallel
from fastpar.testing import RankError, nudge, run_ranks
from fastpar.zero import ZeroOptimizer


def _router_on_logits(logits: torch.Tensor, **kw) -> tuple[TopKRouter, object]:
    """A router whose gate is the identity, so its logits are exactly the inputs."""
    _, e = logits.shape
    r = TopKRouter(e, e, **kw)
    with torch.no_grad():
        r.weight.copy_(torch.eye(e))
    return r, r(logits)


def test_capacity_arithmetic():
    assert capacity_for(10, 4, 2, 1.25, 4) == 7  # ceil(2 * 10 / 4 * 1.25) = ceil(6.25)
    assert capacity_for(10, 4, 1, 1.0, 4) == 4  # ceil(2.5) = 3, raised to the minimum 4
    assert capacity_for(64, 8, 2, 1.0, 1) == 16
    assert capacity_for(64, 8, 2, None, 1) is None


def test_position_policy_drops_latest_and_second_choices_first():
    # 4 tokens, 3 experts; every token's first choice is expert 0, second choice expert 1
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    _, routing = _router_on_logits(logits, top_k=2, capacity_factor=0.5, min_capacity=2)
    assert routing.capacity == 2  # max(2, ceil(2 * 4 / 3 * 0.5) = 2)
    assert routing.expert_ids.tolist() == [[0, 1]] * 4
    _, info = moe_permute(torch.randn(4, 3), routing.expert_ids, 3, routing.capacity, routing.order)
    kept = (info.slots >= 0).tolist()
    # expert 0 keeps tokens 0, 1 (first choices); expert 1 keeps tokens 0, 1 (second choices)
    assert kept == [[True, True], [True, True], [False, False], [False, False]]
    assert info.num_dropped.item() == 4
    assert info.counts.tolist() == [4, 4, 0]


def test_position_policy_first_choices_beat_earlier_second_choices():
    # token 0 picks expert 1 second; tokens 1, 2 pick expert 1 first: they win the 2 slots
    logits = torch.tensor([[3.0, 2.0, 0.0], [0.0, 3.0, 2.0], [0.0, 3.0, 2.0]])
    _, routing = _router_on_logits(logits, top_k=2, capacity_factor=0.1, min_capacity=2)
    _, info = moe_permute(torch.randn(3, 3), routing.expert_ids, 3, 2, routing.order)
    assert routing.expert_ids.tolist() == [[0, 1], [1, 2], [1, 2]]
    assert (info.slots >= 0).tolist() == [[True, False], [True, True], [True, True]]


def test_probs_policy_keeps_most_probable():
    # all four tokens go to expert 0 (top-1); capacity 2 keeps the two most confident
    logits = torch.tensor([[1.0, 0.0], [4.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    _, routing = _router_on_logits(
        logits, top_k=1, capacity_factor=0.5, min_capacity=2, drop_policy="probs"
    )
    _, info = moe_permute(torch.randn(4, 2), routing.expert_ids, 2, routing.capacity, routing.order)
    assert (info.slots[:, 0] >= 0).tolist() == [False, True, False, True]
    _, routing = _router_on_logits(
        logits, top_k=1, capacity_factor=0.5, min_capacity=2, drop_policy="position"
    )
    _, info = moe_permute(torch.randn(4, 2), routing.expert_ids, 2, routing.capacity, routing.order)
    assert (info.slots[:, 0] >= 0).tolist() == [True, True, False, False]


def test_combine_weights_and_aux_losses_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 1.5, 0.0], [1.0, 1.0, 3.0, 0.0]])
    r, routing = _router_on_logits(
        logits, top_k=2, capacity_factor=None, aux_loss_coef=0.1, z_loss_coef=0.01
    )
    # the router's weights against the formula, in fp32 and (the exact math) float64
    p, p64 = torch.softmax(logits, -1), torch.softmax(logits.double(), -1)
    ids = routing.expert_ids
    # renormalised over the two kept choices
    w = r.combine_weights(routing, torch.zeros_like(ids))
    top, top64 = p.gather(1, ids), p64.gather(1, ids)
    ren, ren64 = top / top.sum(1, keepdim=True), top64 / top64.sum(1, keepdim=True)
    agree(w, ren, ren64, "renormalised weights", length=4)
    # a dropped second choice leaves the first with weight 1
    w = r.combine_weights(routing, torch.tensor([[0, -1], [0, 0], [0, 0]]))
    assert w[0].tolist() == [1.0, 0.0]
    # load balancing: E * sum_i f_i P_i, f over the T*k choices
    counts = torch.bincount(ids.flatten(), minlength=4)
    balance, z = r.aux_losses(routing, counts)
    f = [counts[i].item() / 6 for i in range(4)]
    pbar = [p64[:, i].mean().item() for i in range(4)]
    want = 0.1 * 4 * sum(fi * pi for fi, pi in zip(f, pbar, strict=True))
    assert balance.item() == pytest.approx(want, rel=1e-6)
    lse = [math.log(sum(math.exp(v) for v in row)) for row in logits.tolist()]
    assert z.item() == pytest.approx(0.01 * sum(v * v for v in lse) / 3, rel=1e-6)
    # Switch (k = 1): raw top-1 probability, no renormalisation
    r1, routing1 = _router_on_logits(logits, top_k=1, capacity_factor=None)
    w1 = r1.combine_weights(routing1, torch.zeros(3, 1, dtype=torch.long))
    agree(w1, p.max(1, keepdim=True).values, p64.max(1, keepdim=True).values, "top-1", length=4)


def test_balanced_routing_gives_unit_aux_loss():
    r = TopKRouter(4, 4, top_k=1, aux_loss_coef=1.0)
    with torch.no_grad():
        r.weight.copy_(torch.eye(4) * 50)  # one-hot routing, one token per expert
    routing = r(torch.eye(4))
    balance, _ = r.aux_losses(routing, torch.ones(4, dtype=torch.long))
    assert balance.item() == pytest.approx(1.0, rel=1e-4)


def _ep_parity(num_experts: int, capacity_factor, top_k: int, policy: str) -> None:
    """Each EP rank routes its own tokens; outputs and all gradients equal the single-process
    layer holding every expert, applied to each rank's tokens (judged by the rule against its
    float64 copy)."""
    ep = dist.get_world_size()
    mesh = make_mesh(ep=ep)
    kw = dict(
        capacity_factor=capacity_factor,
        top_k=top_k,
        drop_policy=policy,
        min_capacity=2,
        z_loss_coef=1e-3,
    )
    torch.manual_seed(0)
    ref = MoE(12, 20, num_experts, **kw)
    torch.manual_seed(0)
    moe = MoE(12, 20, num_experts, mesh=mesh, **kw)
    xs = [torch.randn(3, 7, 12, generator=torch.Generator().manual_seed(10 + r)) for r in range(ep)]
    gs = [torch.randn(3, 7, 12, generator=torch.Generator().manual_seed(20 + r)) for r in range(ep)]
    run = ep_run(moe, ref, xs, gs)
    n = max(21 * ep, 20)  # the tokens an expert's gradient sums over, the FFN width
    agree_ep(moe, ref, run, n)


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize(
    "capacity_factor,top_k,policy", [(1.0, 2, "position"), (0.5, 1, "probs"), (None, 2, "position")]
)
def test_expert_parallel_equals_single_process(ep, num_experts, capacity_factor, top_k, policy):
    run_ranks(_ep_parity, ep, num_experts, capacity_factor, top_k, policy)


class TinyMoEModel(nn.Module):
    def __init__(self, mesh=None, vocab=31, h=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.norm = nn.LayerNorm(h)
        self.moe = MoE(h, 32, 4, top_k=2, capacity_factor=None, mesh=mesh, aux_loss_coef=0.05)
        self.head = nn.Linear(h, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.moe(self.norm(x)))


def _dp_ep_training(kind: str) -> list[float]:
    """4 SGD steps under DP x EP against the single-process model on the whole batch: every
    step's loss and every parameter afterwards, judged by the rule against a float64 run of the
    same training, with a twin (weights one rounding away: ``nudge``) beside the fp32 run."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = make_mesh(ep=2)  # world 4: dp 4, ep 2, expert-dp 2; world 2: expert-dp 1
    torch.manual_seed(0)
    ref = TinyMoEModel()
    ref.moe.aux_loss_scale = 1.0 / world  # its aux loss weighs like the loss it belongs to
    twin = copy.deepcopy(ref)
    nudge(twin, seed=1)
    refs = (ref, twin, exact_copy(ref))  # fp32, its twin, float64
    torch.manual_seed(0)
    opts_r = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in refs]
    if kind == "ddp":
        model = DistributedDataParallel(TinyMoEModel(mesh=mesh), mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    else:  # ZeRO shards expert parameters over the expert-DP group, the rest over DP
        model = nn.Module()
        model.module = TinyMoEModel(mesh=mesh)
        opt = ZeroOptimizer(
            torch.optim.SGD(model.module.parameters(), lr=0.2, momentum=0.9),
            stage=int(kind[-1]),
            mesh=mesh,
            bucket_size_mb=1e-3,
        )
        model.forward = model.module.forward
    # SGD: linear in the gradients, so fp32 rounding is not amplified as Adam's m / sqrt(v)
    # amplifies it for near-zero gradients
    n = max(world * 12, 32)  # the batch's tokens (a weight gradient's sum), the FFN width
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        idx, tgt = (
            torch.randint(0, 31, (world, 2, 6), generator=g),
            torch.randint(0, 31, (world, 2, 6), generator=g),
        )
        # reference: the mean over ranks of each rank's (task + aux) loss (the aux losses
        # reach backward by themselves; adding their detached values makes the loss comparable)
        ref_losses = []
        for m, o in zip(refs, opts_r, strict=True):
            loss_r = (
                sum(
                    F.cross_entropy(m(idx[r]).flatten(0, 1), tgt[r].flatten()) + moe_aux_loss(m)
                    for r in range(world)
                )
                / world
            )
            o.zero_grad()
            loss_r.backward()
            o.step()
            ref_losses.append(loss_r.detach())
        loss = F.cross_entropy(model(idx[rank]).flatten(0, 1), tgt[rank].flatten()) + moe_aux_loss(
            model
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        agree(total / world, ref_losses[:2], ref_losses[2], f"loss at step {step}", length=n)
        losses.append(float(total / world))
    m = model.module
    lo = mesh.ep_rank * m.moe.num_local
    for name, p in m.named_parameters():
        expert = name.startswith("moe.w") or name.startswith("moe.b")
        want = [r.get_parameter(name).detach() for r in refs]
        want = [q[lo : lo + m.moe.num_local] if expert else q for q in want]
        agree(p.detach(), want[:2], want[2], f"{name} after 4 steps", length=n)
    return losses


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_moe_transformer_under_dp_x_ep_trains_like_single_process(kind, world):
    out = run_ranks(_dp_ep_training, world, kind)
    assert all(o == out[0] for o in out)


def _bad_ep() -> None:
    MoE(8, 8, 6, mesh=make_mesh(ep=4))


def test_experts_not_divisible_by_ep():
    with pytest.raises(
        RankError, match="num_experts 6 is not divisible by the expert-parallel size 4"
    ):
        run_ranks(_bad_ep, 4)


def test_bad_router_arguments():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\]"):
        TopKRouter(8, 4, top_k=5)
    with pytest.raises(ValueError, match="drop_policy must be one of"):
        TopKRouter(8, 4, drop_policy="random")
    with pytest.raises(ValueError, match="capacity_factor must be positive or None"):
        TopKRouter(8, 4, capacity_factor=0.0)
    moe = MoE(8, 16, 4)
    with pytest.raises(ValueError, match=r"MoE expects input \[\.\.\., 8\], got \(2, 7\)"):
        moe(torch.randn(2, 7))


def test_deterministic_under_a_seed():
    def run():
        torch.manual_seed(3)
        moe = MoE(8, 16, 4, jitter=0.1)
        x = torch.randn(5, 8)
        return moe(x)

    assert torch.equal(run(), run())  # the same kernels on the same inputs: bit for bit


def _uneven_capacity(steps_before: int, overlap_chunks: int) -> str:
    mesh = make_mesh(ep=2)
    torch.manual_seed(0)
    moe = MoE(8, 8, 4, top_k=1, capacity_factor=1.0, overlap_chunks=overlap_chunks, mesh=mesh)
    for _ in range(steps_before):  # equal batches pass the check
        moe(torch.randn(40, 8))
    # 40 vs 60 tokens: capacities 10 vs 15 (10 vs 14 tokens would both hit min_capacity 4)
    try:
        moe(torch.randn(40 + 20 * dist.get_rank(), 8))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("steps_before,overlap_chunks", [(0, 1), (2, 1), (1, 2)])
def test_uneven_tokens_in_capacity_mode_is_a_clear_error_on_every_rank(
    steps_before, overlap_chunks
):
    messages = run_ranks(_uneven_capacity, 2, steps_before, overlap_chunks, timeout=60)
    for m in messages:  # every rank raised (none left waiting in an all-to-all)
        assert "routed [40, 60] tokens, giving capacities [10, 15]" in m
        assert "capacity_factor=None" in m
