"""Zero-bubble ZB-H1 (backward split into B, the input gradient, and W, the weight gradients)
equals the unpipelined model: losses and every gradient at pp 2 and 4, m = p and 2p, on plain
Linear stacks, GPT-style blocks and tuple messages, through the trainer with TP, DP + ZeRO-1 and
MoE over EP (each gradient reduced once, each TP collective run once); the order and errors.

Pipelined against unpipelined results are judged by ``fastpar.tolerance``'s rule (micro-batch
sums are not the whole batch's: ``dense_references`` / ``check_step`` of tests/_pipeline.py).
W's weight gradients are the products autograd would run, so a split backward equals a plain one
bit for bit; ZB-H1 and 1F1B run the same forward on the same micro-batches, so their losses
are equal too."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from _flags import tiny_config
from _mesh import make_mesh
from _pipeline import batch, blocks, check_step, dense_name, dense_references, loss_fn, tuple_blocks
from torch import nn

from fastpar.parallel.pipeline import (
    OneFOneB,
    PipelineEngine,
    ZeroBubbleH1,
    build_stage,
    make_schedule,
)
from fastpar.parallel.pipeline.zb import SplitBackward
from fastpar.testing import run_ranks

CASES = [(p, m) for p in (2, 4) for m in (p, 2 * p)]


@pytest.mark.parametrize("p, m", [*CASES, (4, 3), (3, 7)])
def test_order(p, m):
    """Per stage: every micro-batch once as F, B, W in that order; B on stage s after B on
    s + 1 (the simulator's dependency: it runs without deadlock); no more micro-batches in
    flight (F done, W not) than 1F1B's peak, min(p, m)."""
    sched = ZeroBubbleH1(m)
    for s in range(p):
        steps = sched.steps(p, s)
        assert sorted(steps) == sorted((k, i) for k in "FBW" for i in range(m))
        for i in range(m):
            assert steps.index(("F", i)) < steps.index(("B", i)) < steps.index(("W", i))
        fb = [st for st in steps if st[0] != "W"]
        assert fb == OneFOneB(m).steps(p, s)  # 1F1B's order of F and B
        assert sched.max_in_flight(p, s) <= OneFOneB(m).max_in_flight(p, 0)
    start, _ = sched.simulate(p)
    for s in range(p - 1):
        for i in range(m):
            assert start[(s, ("B", i, 0))] >= start[(s + 1, ("B", i, 0))] + 1
    if m < p:  # too few micro-batches for a steady state: still never worse than 1F1B
        assert sched.bubble_fraction(p) < OneFOneB(m).bubble_fraction(p)
    else:
        assert sched.bubble_fraction(p) == pytest.approx(sched.theory(p))
        assert sched.bubble_fraction(p) <= OneFOneB(m).bubble_fraction(p) / 2 + 1e-9
    assert "W0" in sched.timeline(p)


def _mlp(n: int, h: int = 12) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(h, 2 * h), nn.Tanh(), nn.Linear(2 * h, h)) for _ in range(n)]


def _mlp_batch(size: int, step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 12, generator=g), torch.randn(size, 12, generator=g)


def _parity(m: int, make, name: str, n: int, refs) -> float:
    """Two SGD steps of ``name`` pipelined: at each step the unpipelined model's loss and
    every gradient (``refs``: ``_references(m, make, n)``)."""
    mesh = make_mesh(pp="world")
    stage, (lo, _) = build_stage(make(n), mesh.pp_size, mesh.pp_rank)
    lf = nn.functional.mse_loss if make is _mlp else loss_fn
    engine = PipelineEngine(stage, mesh, make_schedule(name, m), loss_fn=lf)
    opt_s = torch.optim.SGD(stage.parameters(), lr=0.5)
    hits = {id(q): 0 for q in stage.parameters()}
    for q in stage.parameters():
        q.register_post_accumulate_grad_hook(lambda q: hits.__setitem__(id(q), hits[id(q)] + 1))
    for step in range(2):
        x, y = _mlp_batch(4 * m, step) if make is _mlp else batch(step, 4 * m)
        opt_s.zero_grad()
        loss_p = engine.train_step(x, y)
        grads = [(dense_name(pname, lo), q.grad) for pname, q in stage.named_parameters()]
        check_step(refs, step, loss_p, grads, f"stage {mesh.pp_rank}, step {step + 1}: ")
        opt_s.step()
    assert set(hits.values()) == {2 * m}  # every parameter's hook: once per micro-batch
    return engine.stats["max_in_flight"]


def _references(m: int, make, n: int):
    """``_parity``'s unpipelined training: fp32, its twin, float64."""
    if make is not _mlp:
        return dense_references(functools.partial(make, n), 2, 4 * m)
    return dense_references(
        functools.partial(_mlp, n),
        2,
        4 * m,
        data=functools.partial(_mlp_batch, 4 * m),
        loss=nn.functional.mse_loss,
        length=4 * m * 12,
    )


@pytest.mark.parametrize("p, m", CASES)
@pytest.mark.parametrize("model", ["linear", "gpt-blocks", "tuple-messages"])
def test_equals_unpipelined(p, m, model):
    make, n = {"linear": (_mlp, 2 * p), "gpt-blocks": (blocks, 2 * p - 2)}.get(
        model, (tuple_blocks, 2 * p - 2)
    )
    peaks = run_ranks(_parity, p, m, make, "zb-h1", n, _references(m, make, n))
    assert max(peaks) == min(p, m)  # 1F1B's peak (its first stage)


def test_split_backward_single_process():
    """B returns the input grad and touches no .grad; W fills every .grad once, exactly."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.LayerNorm(7), nn.Linear(7, 3))
    x = torch.randn(4, 5, requires_grad=True)
    out = net(x)
    g = torch.randn_like(out)
    ref = torch.autograd.grad(out, [x, *net.parameters()], g, retain_graph=True)
    split = SplitBackward([out], [g], [x])
    (dx,) = split.input_grads()
    assert all(q.grad is None for q in net.parameters())
    split.weights()
    # the same products as autograd's (see the next test): bit for bit
    assert torch.equal(dx, ref[0]), "input grad"
    for q, r in zip(net.parameters(), ref[1:], strict=True):
        assert torch.equal(q.grad, r), "weight grad"


class _Products(nn.Module):
    """Every matrix product shape W's direct path takes or leaves: a Linear on 3-D input
    (addmm on a flattened view), one without bias (mm), a row-major weight (x @ w), addmm
    with alpha and beta (of a constant matrix: the bias only; of a parameter), and a LayerNorm
    (not a product: through the engine)."""

    def __init__(self, dtype):
        super().__init__()
        self.a = nn.Linear(6, 8, dtype=dtype)
        self.b = nn.Linear(8, 8, bias=False, dtype=dtype)
        self.w = nn.Parameter(torch.randn(8, 5, dtype=dtype))
        self.bias = nn.Parameter(torch.randn(5, dtype=dtype))
        self.m, self.c = (nn.Parameter(torch.randn(*s, dtype=dtype)) for s in ((5, 5), (5,)))
        self.norm = nn.LayerNorm(5, dtype=dtype)

    def forward(self, x):
        h = self.b(torch.nn.functional.gelu(self.a(x))).flatten(0, 1)
        h = h @ self.w
        h = torch.addmm(self.bias, h, torch.eye(5, dtype=h.dtype), beta=0.5, alpha=2.0)
        h = torch.addmm(self.c, h, self.m, beta=0.25, alpha=3.0)
        return self.norm(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_weight_grads_equal_the_engines_bit_for_bit(dtype, monkeypatch):
    """W computes torch's matrix products' weight gradients itself (no engine call each):
    equal bit for bit, accumulated promptly or at the end, to W through the engine and to a
    plain backward, every parameter's hook firing once per W; and taken for every
    product here (5 of them: the addmm of a constant matrix has only its bias to give), never
    for the LayerNorm."""
    from fastpar.parallel.pipeline import zb

    torch.manual_seed(0)
    base = _Products(dtype)
    x0, g = torch.randn(3, 4, 6, dtype=dtype), torch.randn(12, 5, dtype=dtype)
    taken, real = [], zb._direct_weight_grads

    def spy(n, *args):
        out = real(n, *args)
        taken.append((n.name(), out is not None))
        return out

    monkeypatch.setattr(zb, "_direct_weight_grads", spy)
    results, fired = [], []
    for mode in ("prompt", "direct", "engine", "plain"):
        net, x = copy.deepcopy(base), x0.clone().requires_grad_()
        hooks = [q.register_post_accumulate_grad_hook(fired.append) for q in net.parameters()]
        out = net(x)
        if mode == "plain":
            out.backward(g)
            results.append([x.grad, *[q.grad for q in net.parameters()]])
            continue
        monkeypatch.setattr(zb, "DIRECT", mode != "engine")
        split = SplitBackward([out], [g], [x])
        (dx,) = split.input_grads()
        split.weights(prompt=mode == "prompt")
        results.append([dx, *[q.grad for q in net.parameters()]])
        for h in hooks:
            h.remove()
    for prompt, direct, engine, plain in zip(*results, strict=True):
        assert torch.equal(prompt, plain) and torch.equal(direct, plain)
        assert torch.equal(engine, plain)
    assert len(fired) == 4 * len(list(base.parameters()))  # each hook once per backward
    assert sorted(taken) == sorted(
        (
            [("AddmmBackward0", True)] * 3
            + [("MmBackward0", True)] * 2
            + [("NativeLayerNormBackward0", False)]
        )
        * 2
    ), taken


@pytest.mark.parametrize("meet", ["two casts", "a root off the path"])
def test_prompt_weights_fall_back_when_two_weight_sides_meet(meet):
    """Two weight sides that meet at one leaf (one parameter cast twice into two products, or
    a product's weight also in a loss term off the activation path): W accumulates them in one
    engine call even when asked to be prompt, so the parameter's hook fires once."""
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    x = torch.randn(3, 4, requires_grad=True)
    if meet == "two casts":  # two weight-side nodes, one leaf
        roots = [(x @ w.float()) @ w.float()]
    else:  # the aux term reaches w without passing the activation path
        roots = [x @ w.float(), w.pow(2).sum().float()]
    grads = [torch.randn_like(roots[0]), *[None] * (len(roots) - 1)]
    ref = torch.autograd.grad(roots, [x, w], grads, retain_graph=True)
    fired = []
    w.register_post_accumulate_grad_hook(fired.append)
    split = SplitBackward(roots, grads, [x])
    (dx,) = split.input_grads()
    split.weights(prompt=True)
    assert len(fired) == 1
    assert torch.equal(dx, ref[0]) and torch.equal(w.grad, ref[1])


@pytest.mark.parametrize("prompt", [False, True], ids=["at-end", "prompt"])
def test_a_parameters_tensor_hook_runs_once(prompt):
    """A parameter's own tensor hook (``register_hook``: ``all_reduce_grad``'s sum over TP, a
    MoE expert's under sequence parallelism) runs once in W, as in a plain backward, also
    behind a node W reruns through the engine (a LayerNorm, a product with a weight): it ran
    twice there (``autograd.grad`` runs it on the gradient it captures), summing twice."""
    torch.manual_seed(0)
    norm, lin, w = nn.LayerNorm(4), nn.Linear(4, 4), nn.Parameter(torch.randn(4))
    params = [*norm.parameters(), w, *lin.parameters()]
    calls: list[int] = []
    for i, p in enumerate(params):  # a hook that changes the gradient, as a sum over TP does
        p.register_hook(lambda g, i=i: (calls.append(i), g * 2)[1])
    x = torch.randn(3, 4, requires_grad=True)
    g = torch.randn(3, 4)
    lin(norm(x) * w).backward(g)
    ref, ref_calls = [p.grad.clone() for p in params], sorted(calls)
    for p in params:
        p.grad = None
    calls.clear()
    split = SplitBackward([lin(norm(x) * w)], [g], [x])
    split.input_grads()
    assert calls == []
    split.weights(prompt=prompt)
    assert sorted(calls) == ref_calls == list(range(len(params)))
    assert all(torch.equal(p.grad, r) for p, r in zip(params, ref, strict=True))


def test_refuses_a_parameter_used_twice():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = x @ lin.weight  # weight used twice, one AccumulateGrad reached from two matmuls
    out = h @ lin.weight
    with pytest.raises(ValueError, match="used at two places"):
        SplitBackward([out], [torch.ones_like(out)], [x]).input_grads()


def _dp_bytes(name: str, zero: int, refs) -> tuple[float, float, list]:
    """PP 2 x DP 2 under the family's Replicate (ZeRO-0) or Shard (ZeRO-1/2): the bytes the
    wrapper sent in one step, and the loss; under Replicate each rank's gradients equal the
    whole model's (the DP average; ZeRO-1/2 keep only their shard reduced). Also how each W
    accumulated (prompt or in one call)."""
    from fastpar.parallel import Replicate, Shard

    prompts, real = [], SplitBackward.weights

    def weights(self, prompt=False):
        prompts.append(prompt)
        return real(self, prompt)

    SplitBackward.weights = weights  # this rank's process only

    mesh = make_mesh(pp=2)
    stage, (lo, _) = build_stage(blocks(2), 2, mesh.pp_rank)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    dp = Shard(stage, sgd, stage=zero, mesh=mesh) if zero else Replicate(stage, sgd, mesh=mesh)
    engine = PipelineEngine(dp, mesh, make_schedule(name, 4), loss_fn=loss_fn)
    x, y = batch(0, 16)
    half = slice(mesh.dp_rank * 8, mesh.dp_rank * 8 + 8)
    sent = dp.comm_bytes
    loss = engine.train_step(x[half], y[half])
    if zero == 0:
        grads = [(dense_name(pname, lo), q.grad) for pname, q in stage.named_parameters()]
        check_step(refs, 0, None, grads, f"rank {mesh.rank}: ")
    return dp.comm_bytes - sent, float(loss), prompts


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_dp_reduces_every_gradient_once(zero):
    """The wrapper sends exactly what it sends under 1F1B: each gradient reduced once. The W
    passes inside no_sync accumulate promptly under ZeRO 0 / 1; the one that reduces, and
    every one under ZeRO-2 (which reduces every backward), in one engine call."""
    refs = dense_references(functools.partial(blocks, 2), 1, 16)
    zb = run_ranks(_dp_bytes, 4, "zb-h1", zero, refs)
    ref = run_ranks(_dp_bytes, 4, "1f1b", zero, refs)
    assert [b for b, _, _ in zb] == [b for b, _, _ in ref] and all(b > 0 for b, _, _ in zb)
    # the same forwards of the same micro-batches: the same losses, bit for bit
    assert [loss for _, loss, _ in zb] == [x for _, x, _ in ref]
    for _, _, prompts in zb:  # 4 micro-batches: 4 W passes a rank
        assert prompts == ([True] * 3 + [False] if zero < 2 else [False] * 4), prompts


SMALL = tiny_config()


@pytest.mark.parametrize(
    "layout",
    [
        # (TP, DP x EP with MoE at m = p: tests/test_verify_matrix.py's zb-h1 cases)
        dict(tp=1, pp=2, dp=2, ep=1, zero=1, microbatches=4),
        dict(tp=1, pp=4, dp=1, ep=1, zero=0, microbatches=8, layers=2),
        dict(tp=1, pp=2, dp=2, ep=1, zero=2, microbatches=4, recompute=True),
        dict(tp=2, pp=2, dp=1, ep=1, zero=1, microbatches=2, recompute=True),
        dict(tp=2, pp=2, dp=1, ep=1, zero=1, microbatches=4, sequence_parallel=True),
    ],
    ids=["pp2-dp2-z1-m4", "pp4-m8", "pp2-dp2-z2-full", "tp2-pp2-full", "tp2-pp2-sp"],
)
def test_verify_zb_agrees_with_single_process(layout):
    """The trainer's zb-h1 run (losses, grad norms — a gradient reduced twice moves it — and
    the parameters after the steps) equals the single-process model: DP + ZeRO-1, TP (its
    collectives run once, in B or W) with and without sequence parallelism (its norms' weight
    gradients all-reduced in W), MoE experts over EP."""
    from fastpar.train import TrainConfig
    from fastpar.verify import compare

    ok, text = compare(TrainConfig.from_flags(**{**SMALL, **layout, "schedule": "zb-h1"}))
    assert ok, text


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(recompute="attention"), "zb-h1 with a selective --recompute"),
        (dict(zero=3, dp=2), "zb-h1 with --zero 3"),
        (dict(virtual_stages=2), "needs --schedule interleaved"),
        # refused before any rank starts (the ranks refused it, each, one step in)
        (dict(fused_ce=True), "zb-h1 with --fused-ce at --pp > 1: the fused linear"),
    ],
)
def test_config_refusals(flags, match):
    from fastpar.train import TrainConfig

    cfg = TrainConfig.from_flags(**{**SMALL, "pp": 2, "schedule": "zb-h1", **flags})
    with pytest.raises(ValueError, match=match):
        cfg.check()


def _tp_collectives(name: str) -> tuple[int, float]:
    """TP 2 x PP 2 blocks (Column/RowParallelLinear): how many all-reduces one step runs (the
    forward's and the backward's), and the loss."""
    from fastpar.comm import collectives

    mesh = make_mesh(tp=2, pp=2)
    stage, _ = build_stage(blocks(2, tp_mesh=mesh), 2, mesh.pp_rank)
    engine = PipelineEngine(stage, mesh, make_schedule(name, 4), loss_fn=loss_fn)
    calls, original = [0], collectives._all_reduce
    collectives._all_reduce = lambda *a: (calls.__setitem__(0, calls[0] + 1), original(*a))[1]
    try:
        loss = engine.train_step(*batch(0, 8))
    finally:
        collectives._all_reduce = original
    return calls[0], float(loss)


def test_tp_collectives_run_once():
    """No TP collective runs in both B and W: the same count as 1F1B's."""
    zb, ref = run_ranks(_tp_collectives, 4, "zb-h1"), run_ranks(_tp_collectives, 4, "1f1b")
    assert [c for c, _ in zb] == [c for c, _ in ref] and all(c > 0 for c, _ in zb)
    assert [x for _, x in zb] == [x for _, x in ref]  # the same forwards: bit for bit


class _WeightTimesX(torch.autograd.Function):
    """A custom Function of an activation and a weight (its backward could communicate)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


def test_refuses_a_custom_function_of_a_weight():
    w = nn.Parameter(torch.ones(3))
    x = torch.randn(2, 3, requires_grad=True)
    out = _WeightTimesX.apply(x, w)
    with pytest.raises(ValueError, match="custom autograd Function _WeightTimesX"):
        SplitBackward([out], [torch.ones_like(out)], [x]).input_grads()


def _sp_norms_w(found_in: str) -> list[bool]:
    """2 TP ranks, each its own chunk of the sequence through norms whose weight gradients are
    partial sums (all-reduced over TP in backward: sequence parallelism's norms) between
    linears: one prompt split backward against a plain one, per parameter bit for bit. The
    nodes of the activation path are found in ascending creation order on rank 0 and
    descending on rank 1 when ``found_in`` is "opposite orders" (two ranks' allocation
    histories make a set's order differ so)."""
    import torch.distributed as dist

    from fastpar.models.common import Norm
    from fastpar.parallel.pipeline import zb

    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [Norm(8, "layernorm", group=None, partial_grad=True), nn.Linear(8, 8)]
    stage = nn.Sequential(*layers)
    with torch.no_grad():  # distinct norm weights, so that mismatched sums show
        for i, p in enumerate(stage.parameters()):
            p.add_(0.1 * i)
    x = torch.randn(4 + rank, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    g = torch.randn(4 + rank, 8, generator=torch.Generator().manual_seed(10 + rank))
    stage(x).backward(g)
    ref = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)

    closure = zb._closure

    def ordered(roots, targets):
        found = sorted(closure(roots, targets), key=lambda n: n._sequence_nr())
        return dict.fromkeys(found[::-1] if rank == 1 else found).keys()

    if found_in == "opposite orders":
        zb._closure = ordered  # this rank's process only
    try:
        out = stage(x)
        split = SplitBackward([out], [g], [x])
        split.input_grads()
        split.weights(prompt=True)  # each norm's weight side (its all-reduce) on its own
    finally:
        zb._closure = closure
    return [torch.equal(p.grad, r) for p, r in zip(stage.parameters(), ref, strict=True)]


@pytest.mark.parametrize("found_in", ["set order", "opposite orders"])
def test_w_collectives_pair_up_whatever_order_the_graph_is_found_in(found_in):
    """W runs the intermediates' weight sides in the graph's creation order, not a set's: the
    TP ranks' all-reduces of sequence-parallel norm weight gradients pair up (they were paired
    by the nodes' addresses: zb-h1 with --sequence-parallel at tp 2 DISAGREED)."""
    assert run_ranks(_sp_norms_w, 2, found_in) == [[True] * 12] * 2
