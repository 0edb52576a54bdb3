"""Pipelined training equals the unpipelined model on the same mini-batch: GPipe and 1F1B,
PP = 2 and 4, m = 1, 3, 8, with and without recomputation; PP x TP, PP x DP, tied embeddings,
schedules and errors.

A pipeline splits the mini-batch into micro-batches, so a weight's gradient is a sum of
micro-batch sums (and its loss a sum of micro-batch means): not the unpipelined model's bits.
"Equals" is ``fastpar.tolerance``'s rule (docs/tolerances.md): each step's loss and every
gradient on every rank against the same training in float64, beside the fp32 unpipelined run
and its twin (weights one rounding away) — ``dense_references`` / ``check_step`` of
tests/_pipeline.py. Two runs of the same micro-batches through the same layers
(recomputation replaying a forward, tied copies stepping alike) are bit-identical and so
compared."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _pipeline import (
    Block,
    H,
    Head,
    T,
    V,
    batch,
    blocks,
    check_step,
    dense_name,
    dense_references,
    loss_fn,
    tuple_blocks,
)
from _training import check, norm, sliced
from torch import nn

from fastpar import tolerance
from fastpar.amp import global_grad_norm
from fastpar.parallel import DistributedDataParallel
from fastpar.parallel.pipeline import (
    GPipe,
    OneFOneB,
    PipelineEngine,
    build_stage,
    partition,
    tie_across_stages,
)
from fastpar.testing import RankError, RankTimeout, run_ranks


def _pipelined(
    schedule_name: str,
    m: int,
    recompute: bool,
    refs: tolerance.References,
    steps: int = 2,
    *,
    make=blocks,
    size: int = 24,
    costs=None,
    measure: bool = False,
    bytes_per_step=None,
) -> int:
    """``steps`` SGD steps of the blocks ``make()`` pipelined: at every step the loss and
    gradients of the unpipelined model (``refs``: ``dense_references(make, steps, size)``);
    ``bytes_per_step(mesh)``: what this rank must send per step. Returns the peak bytes of
    stored activations."""
    mesh = make_mesh(pp="world")
    stage, (lo, _) = build_stage(make(), mesh.pp_size, mesh.pp_rank, costs=costs)
    sched = GPipe(m) if schedule_name == "gpipe" else OneFOneB(m)
    engine = PipelineEngine(
        stage, mesh, sched, loss_fn=loss_fn, recompute=recompute, measure_activations=measure
    )
    opt_s = torch.optim.SGD(stage.parameters(), lr=0.5)
    for step in range(steps):
        x, y = batch(step, size)
        opt_s.zero_grad()
        sent = engine.p2p.bytes_sent
        loss_p = engine.train_step(
            x if mesh.is_first_stage else None, y if mesh.is_last_stage else None
        )
        grads = [(dense_name(n, lo), p.grad) for n, p in stage.named_parameters()]
        check_step(refs, step, loss_p, grads, f"stage {mesh.pp_rank}, step {step + 1}: ")
        if bytes_per_step is not None:
            assert engine.p2p.bytes_sent - sent == bytes_per_step(mesh)
        opt_s.step()
    assert engine.stats["max_in_flight"] == sched.max_in_flight(mesh.pp_size, mesh.pp_rank)
    return engine.stats["peak_activation_bytes"]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
def test_pipelined_equals_unpipelined(pp, schedule, m, recompute):
    run_ranks(_pipelined, pp, schedule, m, recompute, dense_references())


def _recompute_with_dropout() -> list:
    """Recomputation replays the forward's RNG state: dropout masks match, so the gradients
    equal the run that kept its graph."""
    mesh = make_mesh(pp=2)
    out = []
    for recompute in (False, True):
        stage, _ = build_stage(blocks(4, dropout=0.3), 2, mesh.pp_rank)
        engine = PipelineEngine(stage, mesh, OneFOneB(4), loss_fn=loss_fn, recompute=recompute)
        x, y = batch(0, 8)
        torch.manual_seed(123)
        engine.train_step(x, y)
        out.append([p.grad.clone() for p in stage.parameters()])
    for a, b in zip(*out, strict=True):  # the same micro-batches through the same layers
        assert torch.equal(a, b)
    return [len(out[0])]


def test_recompute_replays_dropout():
    run_ranks(_recompute_with_dropout, 2)


def _pp_tp(refs: tolerance.References) -> None:
    """PP = 2 x TP = 2: tensor-parallel blocks inside each stage."""
    mesh = make_mesh(tp=2, pp=2)
    par_blocks = blocks(4, tp_mesh=mesh)  # same seed: the TP slices of the dense weights
    stage, (lo, _) = build_stage(par_blocks, 2, mesh.pp_rank, costs=[1] * 6)
    engine = PipelineEngine(stage, mesh, OneFOneB(4), loss_fn=loss_fn)
    x, y = batch(0, 8)
    loss_p = engine.train_step(x, y)
    named = {dense_name(n, lo): p for n, p in stage.named_parameters()}
    sliced(refs, named)  # each rank's TP slice of the dense gradients
    check_step(refs, 0, loss_p, [(n, p.grad) for n, p in named.items()], f"rank {mesh.rank}: ")


def test_pp_x_tp():
    run_ranks(_pp_tp, 4, dense_references(lambda: blocks(4), 1, 8))


def _pp_dp(refs: tolerance.References) -> None:
    """PP = 2 x DP = 2: each replica pipelines its half of the batch; DDP reduces once."""
    mesh = make_mesh(pp=2)
    stage, (lo, _) = build_stage(blocks(4), 2, mesh.pp_rank, costs=[1] * 6)
    ddp = DistributedDataParallel(stage, mesh=mesh)
    calls = []
    original = ddp.reducer._launch

    def counting_launch(b):
        calls.append(b.index)
        return original(b)

    ddp.reducer._launch = counting_launch
    engine = PipelineEngine(ddp, mesh, GPipe(4), loss_fn=loss_fn, no_sync=ddp.no_sync)
    x, y = batch(0, 16)
    half = slice(mesh.dp_rank * 8, mesh.dp_rank * 8 + 8)
    loss_p = engine.train_step(x[half], y[half], broadcast_loss=True)
    assert len(calls) == len(ddp.buckets), "gradients must be reduced once, in the last backward"
    loss_all = loss_p.clone()
    dist.all_reduce(loss_all, group=mesh.dp_group)
    grads = [(dense_name(n, lo), p.grad) for n, p in stage.named_parameters()]
    check_step(refs, 0, loss_all / 2, grads, f"rank {mesh.rank}: ")


def test_pp_x_dp():
    run_ranks(_pp_dp, 4, dense_references(lambda: blocks(4), 1, 16))


class TiedHead(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return F.linear(x, self.weight).flatten(0, 1)


def _tied_dense() -> nn.Module:
    torch.manual_seed(0)
    emb = nn.Embedding(V, H)
    return nn.Sequential(emb, Block(), Block(), TiedHead(emb.weight))


def _tied(refs: tolerance.References) -> torch.Tensor:
    """Embedding on stage 0, LM head sharing its weight on stage 1 (held on both)."""
    mesh = make_mesh(pp=2)
    emb, *mid, _ = _tied_dense()
    torch.manual_seed(mesh.rank + 7)  # deliberately different: tie_across_stages must sync
    if mesh.is_first_stage:
        stage_emb = copy.deepcopy(emb)
        stage, lo = nn.Sequential(stage_emb, copy.deepcopy(mid[0])), 0
        tied = stage_emb.weight
    else:
        tied = nn.Parameter(torch.randn(V, H))
        stage, lo = nn.Sequential(copy.deepcopy(mid[1]), TiedHead(tied)), 2
    tie_across_stages(tied, mesh)
    engine = PipelineEngine(stage, mesh, OneFOneB(2), loss_fn=loss_fn, tied=[tied])
    opt_s = torch.optim.SGD(stage.parameters(), lr=0.5)
    for step in range(3):
        x, y = batch(step, 8)
        opt_s.zero_grad()
        loss_p = engine.train_step(x, y)
        # the tied grad: the embedding's and the head's contributions (dense "0.weight")
        grads = [(dense_name(n, lo), p.grad) for n, p in stage.named_parameters()]
        check_step(refs, step, loss_p, grads, f"stage {mesh.pp_rank}, step {step + 1}: ")
        # the norm counts the tied weight once
        got = global_grad_norm(stage.parameters(), mesh=mesh)
        check([norm(refs, step, got)], f"stage {mesh.pp_rank}, step {step + 1}: ")
        opt_s.step()
    check([refs.param("0.weight", tied.detach())], "the tied weight after the steps: ")
    return tied.detach().clone()


def test_tied_embeddings_stay_in_sync():
    a, b = run_ranks(_tied, 2, dense_references(_tied_dense, 3, 8))
    # both copies took identical steps: the same summed gradient, the same update
    assert torch.equal(a, b)


def test_schedules_and_bubble():
    for p in (2, 4):
        for m in (1, 2, 4, 8, 16):
            for sched in (GPipe(m), OneFOneB(m)):
                assert sched.bubble_fraction(p) == pytest.approx((p - 1) / (m + p - 1))
                steps = [sched.steps(p, s) for s in range(p)]
                for st in steps:  # every micro-batch forward once and backward once, F before B
                    assert sorted(st) == sorted(
                        [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
                    )
                    assert all(st.index(("F", i)) < st.index(("B", i)) for i in range(m))
            assert [GPipe(m).max_in_flight(p, s) for s in range(p)] == [m] * p
            assert [OneFOneB(m).max_in_flight(p, s) for s in range(p)] == [
                min(m, p - s) for s in range(p)
            ]
    text = OneFOneB(4).timeline(2)
    assert text.splitlines()[1].startswith("rank 0: F0 F1")
    assert text.splitlines()[2].startswith("rank 1: .. F0 B0 B0 F1")


def test_partition_balances_costs():
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([10, 1, 1, 1, 1, 10], 3) == [(0, 1), (1, 5), (5, 6)]
    assert partition([5], 1) == [(0, 1)]
    with pytest.raises(ValueError, match="the model has 3 blocks but the pipeline has 4 stages"):
        partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match="got 2 costs for 8 blocks"):
        build_stage(blocks(), 2, 0, costs=[1, 2])
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        GPipe(0)


def _indivisible() -> None:
    mesh = make_mesh(pp=2)
    stage, _ = build_stage(blocks(2), 2, mesh.pp_rank)
    x, y = batch(0, 10)
    PipelineEngine(stage, mesh, GPipe(4), loss_fn=loss_fn).train_step(x, y)


def test_batch_not_divisible_is_a_clear_error():
    with pytest.raises(
        RankError, match="inputs hold 10 samples, not divisible into 4 micro-batches"
    ):
        run_ranks(_indivisible, 2)


class Exploding(nn.Module):
    def forward(self, x):
        raise FloatingPointError("stage 1 blew up")


def _exploding() -> None:
    mesh = make_mesh(pp=3)
    stage = (
        nn.Sequential(Exploding())
        if mesh.pp_rank == 1
        else build_stage(blocks(2), 3, mesh.pp_rank)[0]
    )
    x, y = batch(0, 8)
    PipelineEngine(stage, mesh, OneFOneB(4), loss_fn=loss_fn).train_step(x, y)


def test_exception_on_one_stage_fails_every_rank_promptly():
    with pytest.raises(RankError) as info:
        run_ranks(_exploding, 3, timeout=60)
    assert not isinstance(info.value, RankTimeout)
    assert info.value.rank == 1 and "stage 1 blew up" in str(info.value)


# -- multi-tensor stage messages ------------------------------------------------------------


def _tuple_bytes(mesh) -> int:
    """Bytes a rank sends per step of 12 samples: forward every slot but None; backward only
    the gradients of hidden and side (the slots that required grad), nothing for the others."""
    hidden = 12 * T * H * 4
    forward = 2 * hidden + 12 * T * 8 + 12 * T * 1 + 12 * 4
    return (0 if mesh.is_last_stage else forward) + (0 if mesh.is_first_stage else 2 * hidden)


@pytest.mark.parametrize(
    "pp, schedule, m, recompute, measure",
    [
        (2, "gpipe", 3, False, False),
        (2, "1f1b", 4, True, False),
        (4, "1f1b", 3, False, True),
        (4, "gpipe", 2, True, False),
    ],
)
def test_tuple_messages_equal_unpipelined(pp, schedule, m, recompute, measure):
    peaks = run_ranks(
        _pipelined,
        pp,
        schedule,
        m,
        recompute,
        dense_references(tuple_blocks, 2, 12),
        make=tuple_blocks,
        size=12,
        costs=[1] * 6,
        measure=measure,
        bytes_per_step=_tuple_bytes,
    )
    if measure:  # the tensors autograd saved are counted beyond the stored stage inputs
        stored_input = 12 // m * T * H * 4 * 2 + 12 // m * T * (8 + 1) + 12 // m * 4
        assert all(peak > stored_input for peak in peaks[1:])


def _tuple_recompute_with_dropout() -> None:
    """Recomputation of tuple stages replays each forward's RNG state (including the engine's
    one extra forward that learns which output slots require grad): dropout masks match."""
    mesh = make_mesh(pp=2)
    grads = []
    for recompute in (False, True):
        stage, _ = build_stage(tuple_blocks(4, dropout=0.3), 2, mesh.pp_rank, costs=[1] * 6)
        engine = PipelineEngine(stage, mesh, OneFOneB(4), loss_fn=loss_fn, recompute=recompute)
        x, y = batch(0, 8)
        torch.manual_seed(123)
        engine.train_step(x, y)
        torch.manual_seed(321)
        engine.train_step(x, y)  # gradients accumulate over both steps
        grads.append([p.grad.clone() for p in stage.parameters()])
    for a, b in zip(*grads, strict=True):  # the same micro-batches through the same layers
        assert torch.equal(a, b)


def test_tuple_recompute_replays_dropout():
    run_ranks(_tuple_recompute_with_dropout, 2)


def _shapes_batch(step: int):
    """Step 0: 4 x T ids; step 1: 6 x (T - 2) — every slot of the messages changes shape."""
    size, seq = ((4, T), (6, T - 2))[step]
    g = torch.Generator().manual_seed(seq)
    return torch.randint(0, V, (size, seq), generator=g), torch.randint(
        0, V, (size, seq), generator=g
    )


def _tuple_shapes(static: bool, refs: tolerance.References) -> None:
    mesh = make_mesh(pp=2)
    stage, (lo, _) = build_stage(tuple_blocks(2), 2, mesh.pp_rank)
    engine = PipelineEngine(stage, mesh, GPipe(2), loss_fn=loss_fn, static_shapes=static)
    for step in range(2):
        x, y = _shapes_batch(step)
        stage.zero_grad()
        loss_p = engine.train_step(x, y)
        grads = [(dense_name(n, lo), p.grad) for n, p in stage.named_parameters()]
        check_step(refs, step, loss_p, grads, f"stage {mesh.pp_rank}, seq {x.shape[1]}: ")


def _shapes_references() -> tolerance.References:
    """Two steps of different shapes from the same weights (SGD with lr 0)."""
    return dense_references(lambda: tuple_blocks(2), 2, 6, lr=0.0, data=_shapes_batch)


def test_tuple_shapes_may_vary_without_static_shapes():
    run_ranks(_tuple_shapes, 2, False, _shapes_references())


def test_tuple_shape_change_under_static_shapes_is_a_clear_error():
    with pytest.raises(RankError, match=r"changed from \(\(2, 5, 16\) torch.float32 requires_grad"):
        run_ranks(_tuple_shapes, 2, True, _shapes_references())


class BadOutput(nn.Module):
    def forward(self, ids):
        return {"hidden": ids.float()}


def _bad_output() -> None:
    mesh = make_mesh(pp=2)
    stage = nn.Sequential(BadOutput()) if mesh.is_first_stage else nn.Sequential(Head())
    x, y = batch(0, 4)
    PipelineEngine(stage, mesh, GPipe(2), loss_fn=loss_fn).train_step(x, y)


def test_stage_output_not_a_tensor_or_tuple_is_a_clear_error():
    with pytest.raises(RankError, match=r"must return a tensor or a tuple of tensors.*got dict"):
        run_ranks(_bad_output, 2, timeout=60)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Embedding(V, H), nn.Embedding(V, H)

    def forward(self, inputs):
        return self.a(inputs[0]) + self.b(inputs[1])


def _two_inputs_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [TwoInputs(), Block(), Head()]


def _two_inputs_batch(step: int):
    (x, y), (x2, _) = batch(0, 6), batch(1, 6)
    return (x, x2), y


def _tuple_inputs(refs: tolerance.References) -> None:
    """The first stage's inputs may be a tuple: each tensor is split into micro-batches."""
    mesh = make_mesh(pp=2)
    stage, (lo, _) = build_stage(_two_inputs_blocks(), 2, mesh.pp_rank, costs=[1] * 3)
    engine = PipelineEngine(stage, mesh, OneFOneB(3), loss_fn=loss_fn)
    (x, x2), y = _two_inputs_batch(0)
    loss_p = engine.train_step((x, x2), y)
    grads = [(dense_name(n, lo), p.grad) for n, p in stage.named_parameters()]
    check_step(refs, 0, loss_p, grads, f"stage {mesh.pp_rank}: ")
    with pytest.raises(ValueError, match="inputs hold 5 samples, not divisible into 3"):
        engine.train_step((x, x2[:5]), y)


def test_first_stage_takes_a_tuple_of_inputs():
    refs = dense_references(_two_inputs_blocks, 1, 6, data=_two_inputs_batch)
    run_ranks(_tuple_inputs, 2, refs)
