"""Routing modes of today's MoE models (sigmoid scores, top-k scaling, group-limited top-k,
aux-loss-free expert bias, sequence-level aux loss, Megatron's drop semantics): each against a
hand-checked small case, and every mode in the MoE layer against a dense per-token reference
and, at EP 2 / 4, against the single-process layer holding every expert.

The layer against the dense reference, EP against the single-process layer and compiled against
eager are judged by ``fastpar.tolerance``'s rule (docs/tolerances.md): the error against the
same math in float64 at most 4 x the fp32 reference's own plus a floor. Routing is discrete:
the fp32 and float64 runs must choose alike (``same_routing`` of tests/_parity.py), so a near-tie of two scores
fails as that rather than as a large error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _parity import agree, agree_ep, ep_run, exact_copy, same_routing

from fastpar.moe import MoE, TopKRouter, capacity_for
from fastpar.moe.balance import update_expert_bias
from fastpar.ops.moe_permute import moe_permute
from fastpar.testing import run_ranks


def _router(e: int, **kw) -> TopKRouter:
    """A router whose gate is the identity: its logits are exactly its inputs."""
    r = TopKRouter(e, e, **kw)
    with torch.no_grad():
        r.weight.copy_(torch.eye(e))
    return r


def _sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


# -- scores, top-k, scaling -------------------------------------------------------------------
def test_sigmoid_scores_renormalised_and_scaled_by_hand():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.0]])
    r = _router(4, top_k=2, score="sigmoid", scaling_factor=2.5, capacity_factor=None)
    routing = r(logits)
    assert routing.expert_ids.tolist() == [[2, 0]]
    s2, s0 = _sig(2.0), _sig(1.0)
    assert routing.probs[0].tolist() == pytest.approx([s2, s0], rel=1e-6)
    w = r.combine_weights(routing, torch.zeros(1, 2, dtype=torch.long))
    assert w[0].tolist() == pytest.approx([2.5 * s2 / (s2 + s0), 2.5 * s0 / (s2 + s0)], rel=1e-6)
    raw = _router(4, top_k=2, score="sigmoid", normalize_topk=False, capacity_factor=None)
    w = raw.combine_weights(raw(logits), torch.zeros(1, 2, dtype=torch.long))
    assert w[0].tolist() == pytest.approx([s2, s0], rel=1e-6)  # sigmoid scores do not sum to 1


def test_expert_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[1.0, 0.5, 0.0]])
    r = _router(3, top_k=1, score="sigmoid", expert_bias=True, capacity_factor=None)
    assert r(logits).expert_ids.tolist() == [[0]]
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.3]))  # 0.5 + 0.3 > 0.731
    routing = r(logits)
    assert routing.expert_ids.tolist() == [[2]]
    assert routing.probs.item() == pytest.approx(0.5, rel=1e-6)  # sigmoid(0), unbiased


def test_group_limited_topk_by_hand():
    # 6 experts in 3 groups of 2: {0,1} {2,3} {4,5}; scores (softmax of log p = p)
    p = torch.tensor([[0.30, 0.01, 0.20, 0.19, 0.25, 0.05]])
    logits = p.log()
    flat = _router(6, top_k=2, capacity_factor=None)(logits)
    assert flat.expert_ids.tolist() == [[0, 4]]
    # group scores (top-2 sums): 0.31, 0.39, 0.30 -> best group {2,3}
    one = _router(6, top_k=2, num_groups=3, group_topk=1, capacity_factor=None)(logits)
    assert one.expert_ids.tolist() == [[2, 3]]
    # best two groups {2,3}, {0,1}: experts 0, 2
    two = _router(6, top_k=2, num_groups=3, group_topk=2, capacity_factor=None)(logits)
    assert two.expert_ids.tolist() == [[0, 2]]
    # DeepSeek-V2's max-per-group: 0.30, 0.20, 0.25 -> groups {0,1}, {4,5}
    mx = _router(6, top_k=2, num_groups=3, group_topk=2, group_score_topk=1, capacity_factor=None)
    assert mx(logits).expert_ids.tolist() == [[0, 4]]
    assert two.probs[0].tolist() == pytest.approx([0.30, 0.20], rel=1e-5)


def test_group_limited_topk_uses_the_biased_scores():
    p = torch.tensor([[0.30, 0.01, 0.20, 0.19, 0.25, 0.05]])
    r = _router(6, top_k=2, num_groups=3, group_topk=1, expert_bias=True, capacity_factor=None)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.2, 0.0, 0.0, 0.0, 0.0]))  # group 0: 0.51
    routing = r(p.log())
    assert routing.expert_ids.tolist() == [[0, 1]]
    assert routing.probs[0].tolist() == pytest.approx([0.30, 0.01], rel=1e-5)


# -- drop semantics ---------------------------------------------------------------------------
def _competing_tokens() -> torch.Tensor:
    """Token A: p0 0.42 beside p1 0.38 (renormalised weight on expert 0: 0.525); token B: p0 0.30
    beside p2 0.11 (weight 0.73). Both want expert 0; capacity 1."""
    a = [0.42, 0.38] + [0.20 / 6] * 6
    b = [0.30, (0.59) / 6, 0.11] + [0.59 / 6] * 5
    return torch.tensor([a, b]).log()


@pytest.mark.parametrize("policy,keep_a", [("position", True), ("probs", True), ("weights", False)])
def test_drop_policies_rank_by_probability_or_by_weight(policy, keep_a):
    logits = _competing_tokens()
    r = _router(8, top_k=2, capacity_factor=1.0, min_capacity=None, drop_policy=policy)
    routing = r(logits)
    assert routing.capacity == 1  # ceil(2 * 2 / 8), no minimum
    assert routing.expert_ids.tolist() == [[0, 1], [0, 2]]
    _, info = moe_permute(torch.randn(2, 8), routing.expert_ids, 8, 1, routing.order)
    kept = (info.slots >= 0).tolist()
    assert kept == ([[True, True], [False, True]] if keep_a else [[False, True], [True, True]])


def test_weights_after_a_drop_renormalised_or_kept():
    logits = _competing_tokens()
    slots = torch.tensor([[-1, 3], [0, 5]])  # A's choice of expert 0 dropped
    ren = _router(8, top_k=2, capacity_factor=1.0, drop_weights="renormalise")
    w = ren.combine_weights(ren(logits), slots)
    assert w[0].tolist() == pytest.approx([0.0, 1.0], rel=1e-6)
    keep = _router(8, top_k=2, capacity_factor=1.0, drop_weights="keep", scaling_factor=2.0)
    w = keep.combine_weights(keep(logits), slots)
    assert w[0].tolist() == pytest.approx([0.0, 2.0 * 0.38 / 0.80], rel=1e-5)
    assert w[1].tolist() == pytest.approx([2.0 * 0.30 / 0.41, 2.0 * 0.11 / 0.41], rel=1e-5)


def test_minimum_capacity_can_be_turned_off():
    assert capacity_for(10, 4, 1, 1.0, 4) == 4
    assert capacity_for(10, 4, 1, 1.0, None) == 3  # ceil(2.5)
    assert capacity_for(10, 4, 1, 1.0, 0) == 3
    assert (
        _router(4, top_k=1, capacity_factor=1.0, min_capacity=None)(torch.randn(10, 4)).capacity
        == 3
    )


# -- auxiliary losses -------------------------------------------------------------------------
def _balance_by_hand(p_rows, ids_rows, k, e, coef) -> float:
    t = len(p_rows)
    f = [sum(row.count(i) for row in ids_rows) / (t * k) for i in range(e)]
    pbar = [sum(row[i] for row in p_rows) / t for i in range(e)]
    return coef * e * sum(a * b for a, b in zip(f, pbar, strict=True))


def test_sigmoid_aux_loss_uses_normalised_scores_by_hand():
    logits = torch.tensor([[1.0, 0.0, -1.0], [0.0, 2.0, 0.5]])
    r = _router(3, top_k=1, score="sigmoid", aux_loss_coef=0.1, capacity_factor=None)
    routing = r(logits)
    assert routing.expert_ids.tolist() == [[0], [1]]
    rows = []
    for row in logits.tolist():
        s = [_sig(v) for v in row]
        rows.append([v / sum(s) for v in s])
    balance, _ = r.aux_losses(routing, torch.tensor([1, 1, 0]))
    assert balance.item() == pytest.approx(_balance_by_hand(rows, [[0], [1]], 1, 3, 0.1), rel=1e-6)


def test_sequence_aux_loss_by_hand():
    # two sequences of two tokens, top-1 over 2 experts
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    r = _router(2, top_k=1, aux_loss="sequence", aux_loss_coef=1.0, capacity_factor=None)
    routing = r(logits, seq_len=2)
    ids = routing.expert_ids.tolist()
    assert ids == [[0], [0], [1], [0]]
    p = [
        [math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))]
        for a, b in logits.tolist()
    ]
    want = (
        _balance_by_hand(p[:2], ids[:2], 1, 2, 1.0) + _balance_by_hand(p[2:], ids[2:], 1, 2, 1.0)
    ) / 2
    balance, _ = r.aux_losses(routing, torch.tensor([3, 1]))
    assert balance.item() == pytest.approx(want, rel=1e-6)
    micro = _balance_by_hand(p, ids, 1, 2, 1.0)
    assert abs(micro - want) > 1e-3  # the two levels differ on this batch
    with pytest.raises(ValueError, match="aux_loss='sequence' needs the sequence length"):
        r.aux_losses(r(logits), torch.tensor([3, 1]))
    none = _router(2, top_k=1, aux_loss=None, capacity_factor=None)
    assert none.aux_losses(none(logits), torch.tensor([3, 1]))[0].item() == 0.0


# -- aux-loss-free balancing: the bias over steps ---------------------------------------------
def _margin_tokens() -> torch.Tensor:
    """Four tokens whose sigmoid score for expert 0 beats expert 1's (0.5) by 0.05 .. 0.35."""
    return torch.tensor([[_logit(0.5 + m), 0.0] for m in (0.05, 0.15, 0.25, 0.35)])


def test_expert_bias_update_over_steps_by_hand():
    r = _router(
        2, top_k=1, score="sigmoid", expert_bias=True, bias_update_rate=0.1, capacity_factor=None
    )
    x = _margin_tokens()
    loads, biases = [], []
    for _ in range(3):
        loads.append(torch.bincount(r(x).expert_ids.flatten(), minlength=2).tolist())
        assert r.tokens_per_expert.tolist() == loads[-1]
        r.update_expert_bias()
        assert r.tokens_per_expert.tolist() == [0, 0]
        biases.append(r.expert_bias.tolist())
    # step 0: all four to expert 0 -> bias -0.1 / +0.1; then the two closest tokens move over
    assert loads == [[4, 0], [2, 2], [2, 2]]
    assert biases[0] == pytest.approx([-0.1, 0.1]) and biases[2] == pytest.approx([-0.1, 0.1])
    # eval forwards and no-grad forwards count nothing
    r.eval()
    r(x)
    r.train()
    with torch.no_grad():
        r(x)
    assert r.tokens_per_expert.tolist() == [0, 0]


def test_expert_bias_lives_in_the_state_dict_and_stays_fp32():
    assert list(TopKRouter(4, 4).state_dict()) == ["weight"]  # default: no new keys
    r = TopKRouter(4, 4, score="sigmoid", expert_bias=True)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([1e-3, -2e-3, 3e-3, 0.123456789]))
    sd = r.state_dict()
    assert sorted(sd) == ["expert_bias", "weight"]
    fresh = TopKRouter(4, 4, score="sigmoid", expert_bias=True)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.expert_bias, r.expert_bias)
    want = r.expert_bias.clone()
    r.to(torch.bfloat16)
    assert r.weight.dtype == torch.bfloat16
    assert r.expert_bias.dtype == torch.float32 and torch.equal(r.expert_bias, want)


def test_expert_bias_survives_a_fastpar_checkpoint(tmp_path):
    from fastpar import checkpoint

    def state(m):  # parameters and persistent buffers under their names
        return {**dict(m.named_parameters()), **dict(m.named_buffers())}

    torch.manual_seed(0)
    model = torch.nn.Sequential(TopKRouter(4, 4, score="sigmoid", expert_bias=True))
    with torch.no_grad():
        model[0].expert_bias.copy_(torch.tensor([0.01, -0.02, 0.03, -0.04]))
    path = str(tmp_path / "c")
    assert "0.tokens_per_expert" not in model.state_dict()
    checkpoint.save(
        path,
        model_params={k: v for k, v in state(model).items() if k in model.state_dict()},
        step=1,
    )
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(TopKRouter(4, 4, score="sigmoid", expert_bias=True))
    checkpoint.load(
        path, model_params={k: v for k, v in state(fresh).items() if k in fresh.state_dict()}
    )
    assert torch.equal(fresh[0].expert_bias, model[0].expert_bias)
    assert torch.equal(fresh[0].weight, model[0].weight)


def _bias_over_dp() -> list[float]:
    """Rank 0 routes its four tokens to expert 0 (load [4, 0, 0]), rank 1 its tokens to experts
    0, 1, 1, 2 (load [1, 2, 1]): both update from the summed load [5, 2, 1]."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        _router(
            3,
            top_k=1,
            score="sigmoid",
            expert_bias=True,
            bias_update_rate=0.25,
            capacity_factor=None,
        )
    )
    hi, lo = _logit(0.9), _logit(0.1)
    rows = {0: [[hi, lo, lo]] * 4, 1: [[hi, lo, lo]] + [[lo, hi, lo]] * 2 + [[lo, lo, hi]]}[rank]
    model(torch.tensor(rows))
    assert update_expert_bias(model, group=dist.group.WORLD) == 1
    return model[0].expert_bias.tolist()


def test_expert_bias_is_identical_on_every_data_parallel_replica():
    out = run_ranks(_bias_over_dp, 2)
    # summed load [5, 2, 1], mean 8/3: expert 0 over, experts 1 and 2 under
    assert out[0] == out[1] == pytest.approx([-0.25, 0.25, 0.25])
    # without the reduction rank 1 alone (load [1, 2, 1], mean 4/3) would move 0 up, 1 down
    r = _router(
        3, top_k=1, score="sigmoid", expert_bias=True, bias_update_rate=0.25, capacity_factor=None
    )
    hi, lo = _logit(0.9), _logit(0.1)
    r(torch.tensor([[hi, lo, lo]] + [[lo, hi, lo]] * 2 + [[lo, lo, hi]]))
    r.update_expert_bias()
    assert r.expert_bias.tolist() == pytest.approx([0.25, -0.25, 0.25])


def test_bad_routing_arguments():
    with pytest.raises(ValueError, match="score must be one of"):
        TopKRouter(8, 4, score="tanh")
    with pytest.raises(ValueError, match="num_groups must divide num_experts=6"):
        TopKRouter(8, 6, num_groups=4, group_topk=1)
    with pytest.raises(ValueError, match="needs both num_groups and group_topk"):
        TopKRouter(8, 6, num_groups=3)
    with pytest.raises(ValueError, match="top_k=4 exceeds the 2 experts of 1 groups"):
        TopKRouter(8, 6, top_k=4, num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="drop_weights must be one of"):
        TopKRouter(8, 4, drop_weights="megatron")
    with pytest.raises(ValueError, match="aux_loss must be one of"):
        TopKRouter(8, 4, aux_loss="global")
    with pytest.raises(ValueError, match="needs a router built with expert_bias=True"):
        TopKRouter(8, 4).update_expert_bias()


# -- every mode in the layer: dense reference, EP 1 / 2 / 4 -----------------------------------
H, FFN, E = 10, 12, 8
MODES = {
    "softmax-top2": dict(top_k=2, capacity_factor=None),
    "deepseek-v3": dict(
        top_k=2,
        capacity_factor=None,
        score="sigmoid",
        expert_bias=True,
        num_groups=4,
        group_topk=2,
        scaling_factor=2.5,
        aux_loss="sequence",
    ),
    "sigmoid-top1-scaled": dict(
        top_k=1, capacity_factor=None, score="sigmoid", scaling_factor=1.5, z_loss_coef=1e-3
    ),
    "megatron-drops": dict(
        top_k=2, capacity_factor=0.5, min_capacity=None, drop_policy="weights", drop_weights="keep"
    ),
    "groups-probs-drops": dict(
        top_k=2,
        capacity_factor=0.75,
        min_capacity=2,
        drop_policy="probs",
        num_groups=2,
        group_topk=1,
        aux_loss="sequence",
    ),
}
BIAS = torch.tensor([0.05, -0.1, 0.0, 0.2, -0.05, 0.1, 0.0, -0.2])


def _moe(opts: dict, mesh=None) -> MoE:
    """A MoE layer with the routing ``opts`` (same seed: same weights at every EP size)."""
    torch.manual_seed(0)
    moe = MoE(H, FFN, E, mesh=mesh, aux_loss_coef=0.05, **opts)
    if moe.router.expert_bias is not None:
        with torch.no_grad():
            moe.router.expert_bias.copy_(BIAS)
    return moe


def _dense_reference(moe: MoE, x: torch.Tensor, opts: dict, dtype=torch.float64) -> torch.Tensor:
    """Per token: the experts HF's DeepSeek-V3 / Mixtral routers would pick, each run alone,
    computed in ``dtype`` (float64: the exact math; fp32: the same in the working precision)."""
    tokens = x.reshape(-1, H).to(dtype)
    logits = tokens @ moe.router.weight.to(dtype).t()
    s = logits.sigmoid() if opts.get("score") == "sigmoid" else logits.softmax(-1)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        sel = s[t].detach() + (BIAS.to(dtype) if opts.get("expert_bias") else 0)
        allowed = list(range(E))
        if opts.get("num_groups"):
            size = E // opts["num_groups"]
            score = [
                sorted(sel[g * size : (g + 1) * size].tolist())[-2:]
                for g in range(opts["num_groups"])
            ]
            best = sorted(range(len(score)), key=lambda g: -sum(score[g]))[: opts["group_topk"]]
            allowed = [i for g in best for i in range(g * size, (g + 1) * size)]
        ids = sorted(allowed, key=lambda i: -float(sel[i]))[: opts["top_k"]]
        w = torch.stack([s[t, i] for i in ids])
        if opts["top_k"] > 1:
            w = w / w.sum()
        w = w * opts.get("scaling_factor", 1.0)
        for wi, i in zip(w, ids, strict=True):
            hid = F.gelu(tokens[t] @ moe.w1[i].to(dtype) + moe.b1[i].to(dtype))
            out[t] += wi * (hid @ moe.w2[i].to(dtype) + moe.b2[i].to(dtype))
    return out.view(x.shape)


@pytest.mark.parametrize("mode", [m for m, o in MODES.items() if o["capacity_factor"] is None])
def test_layer_equals_dense_reference(mode):
    """The layer (fp32) against the dense per-token reference: by the rule, the reference in fp32
    the single-process run and in float64 the exact math."""
    opts = MODES[mode]
    moe = _moe(opts)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, y32, y64 = (
            moe(x),
            _dense_reference(moe, x, opts, torch.float32),
            _dense_reference(moe, x, opts),
        )
    agree(y, y32, y64, f"{mode}: output", length=FFN)


def _ep_parity_all_modes() -> None:
    ep = dist.get_world_size()
    mesh = make_mesh(ep=ep)
    n = max(12 * ep, FFN)  # the tokens an expert's gradient sums over, the FFN width
    for mode, opts in MODES.items():
        ref, moe = _moe(opts), _moe(opts, mesh)
        seeds = [torch.Generator().manual_seed(10 + r) for r in range(ep)]
        xs = [torch.randn(2, 6, H, generator=g) for g in seeds]
        seeds = [torch.Generator().manual_seed(20 + r) for r in range(ep)]
        gs = [torch.randn(2, 6, H, generator=g) for g in seeds]
        run = ep_run(moe, ref, xs, gs)
        if opts["capacity_factor"] is not None:  # the case exercises its drop semantics
            assert int(moe.stats["num_dropped"]) > 0, mode
        agree_ep(moe, ref, run, n, f"{mode}: ")
        if opts.get("expert_bias"):  # each replica's bias update equals the single process's
            assert update_expert_bias(moe, group=mesh.dp_group) == 1
            ref.router.update_expert_bias()  # counted every rank's tokens (twice: same signs)
            assert not torch.equal(moe.router.expert_bias, BIAS)
            # bit for bit: the same +-rate steps from the same integer counts (routing is alike)
            assert torch.equal(moe.router.expert_bias, ref.router.expert_bias), mode


@pytest.mark.parametrize("ep", [2, 4])
def test_every_mode_under_expert_parallelism_equals_single_process(ep):
    run_ranks(_ep_parity_all_modes, ep)


@pytest.mark.parametrize("mode", ["deepseek-v3", "megatron-drops"])
def test_every_mode_compiles_to_one_graph_equal_to_eager(mode):
    """torch.compile (aot_eager, fullgraph): output, aux loss and every gradient agree with
    eager's by the rule (AOT autograd traces its own backward graph: other kernels, other
    rounding, so not bit for bit), against the layer's float64 copy run eagerly; the expert
    bias's token counts (integers) are equal."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    moe = _moe(MODES[mode])
    moe.aux_loss_scale = 0.5  # as fastpar.train sets it (the context variable breaks graphs)
    moe64 = exact_copy(moe)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe, backend=counter, fullgraph=True)
    x0 = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(3))
    same_routing(moe, moe64, [x0])
    results = []
    for f, m, dtype in (
        (moe, moe, torch.float32),
        (compiled, moe, torch.float32),
        (moe64, moe64, torch.float64),
    ):
        x = x0.to(dtype, copy=True).requires_grad_()
        m.zero_grad(set_to_none=True)
        before = None if m.router.expert_bias is None else m.router.tokens_per_expert.clone()
        y = f(x)
        y.square().sum().backward()
        counted = [] if before is None else [m.router.tokens_per_expert - before]
        grads = [p.grad for p in m.parameters()]
        results.append(([y.detach(), m.aux_loss, x.grad, *grads], counted))
    (eager, counts), (got, got_counts), (exact, counts64) = results
    names = ["output", "aux loss", "input grad", *[f"grad {n}" for n, _ in moe.named_parameters()]]
    for what, a, b, c in zip(names, got, eager, exact, strict=True):
        agree(a, b, c, f"{mode}: {what}", length=FFN)
    for want in (counts, counts64):  # integers of the same routing: equal
        assert all(torch.equal(a, b) for a, b in zip(got_counts, want, strict=True)), mode
    assert counter.frame_count == 1
    torch._dynamo.reset()
