"""Pipelined training equals the unpipelined model on the same mini-batch: GPipe and 1F1B,
PP = 2 and 4, m = 1, 3, 8, with and without recomputation; PP x TP, PP x DP, tied embeddings,
schedules and errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import assert_close, local_slice
from torch import nn

from fastpar import ParallelMesh
from fastpar.amp import global_grad_norm
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, param_layout
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

V, H, T = 50, 16, 5


class Block(nn.Module):
    def __init__(self, h: int = H, dropout: float = 0.0, tp_mesh=None):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        if tp_mesh is None:
            self.fc, self.proj = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        else:
            self.fc = ColumnParallelLinear(h, 2 * h, mesh=tp_mesh)
            self.proj = RowParallelLinear(2 * h, h, mesh=tp_mesh)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.proj(F.gelu(self.fc(self.norm(x)))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(H), nn.Linear(H, V)

    def forward(self, x):
        return self.out(self.norm(x)).flatten(0, 1)


def blocks(n: int = 6, dropout: float = 0.0, tp_mesh=None) -> list[nn.Module]:
    torch.manual_seed(0)
    return (
        [nn.Embedding(V, H)]
        + [Block(dropout=dropout, tp_mesh=tp_mesh) for _ in range(n)]
        + [Head()]
    )


def loss_fn(logits, target):
    return F.cross_entropy(logits, target.flatten())


def batch(step: int, size: int = 24):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (size, T), generator=g), torch.randint(0, V, (size, T), generator=g)


def _pipelined(
    schedule_name: str,
    m: int,
    recompute: bool,
    steps: int = 2,
    *,
    make=blocks,
    size: int = 24,
    costs=None,
    measure: bool = False,
    bytes_per_step=None,
) -> int:
    """``steps`` SGD steps of the blocks ``make()`` pipelined and unpipelined: the same loss and
    gradients at every step; ``bytes_per_step(mesh)``: what this rank must send per step.
    Returns the peak bytes of stored activations."""
    mesh = ParallelMesh(pp=dist.get_world_size())
    dense = nn.Sequential(*make())
    stage, (lo, hi) = build_stage(
        copy.deepcopy(list(dense)), mesh.pp_size, mesh.pp_rank, costs=costs
    )
    sched = GPipe(m) if schedule_name == "gpipe" else OneFOneB(m)
    engine = PipelineEngine(
        stage, mesh, sched, loss_fn=loss_fn, recompute=recompute, measure_activations=measure
    )
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.5)
    opt_s = torch.optim.SGD(stage.parameters(), lr=0.5)
    for step in range(steps):
        x, y = batch(step, size)
        loss_d = loss_fn(dense(x), y)
        opt_d.zero_grad()
        loss_d.backward()
        opt_s.zero_grad()
        sent = engine.p2p.bytes_sent
        loss_p = engine.train_step(
            x if mesh.is_first_stage else None, y if mesh.is_last_stage else None
        )
        assert_close(loss_p, loss_d.detach(), f"loss at step {step}")
        for (name, p), q in zip(
            stage.named_parameters(), nn.Sequential(*list(dense)[lo:hi]).parameters(), strict=True
        ):
            assert_close(p.grad, q.grad, f"grad of stage {mesh.pp_rank} {name} at step {step}")
        if bytes_per_step is not None:
            assert engine.p2p.bytes_sent - sent == bytes_per_step(mesh)
        opt_d.step()
        opt_s.step()
    assert engine.stats["max_in_flight"] == sched.max_in_flight(mesh.pp_size, mesh.pp_rank)
    return engine.stats["peak_activation_bytes"]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
def test_pipelined_equals_unpipelined(pp, schedule, m, recompute):
    run_ranks(_pipelined, pp, schedule, m, recompute)


def _recompute_with_dropout() -> list:
    """Recomputation replays the forward's RNG state: dropout masks match, so the gradients
    equal the run that kept its graph."""
    mesh = ParallelMesh(pp=2)
    out = []
    for recompute in (False, True):
        stage, _ = build_stage(blocks(4, dropout=0.3), 2, mesh.pp_rank)
        engine = PipelineEngine(stage, mesh, OneFOneB(4), loss_fn=loss_fn, recompute=recompute)
        x, y = batch(0, 8)
        torch.manual_seed(123)
        engine.train_step(x, y)
        out.append([p.grad.clone() for p in stage.parameters()])
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)
    return [len(out[0])]


def test_recompute_replays_dropout():
    run_ranks(_recompute_with_dropout, 2)


def _pp_tp() -> None:
    """PP = 2 x TP = 2: tensor-parallel blocks inside each stage."""
    mesh = ParallelMesh(tp=2, pp=2)
    dense = nn.Sequential(*blocks(4))
    par_blocks = blocks(4, tp_mesh=mesh)  # same seed: the TP slices of the dense weights
    stage, (lo, hi) = build_stage(par_blocks, 2, mesh.pp_rank, costs=[1] * 6)
    engine = PipelineEngine(stage, mesh, OneFOneB(4), loss_fn=loss_fn)
    x, y = batch(0, 8)
    loss_d = loss_fn(dense(x), y)
    loss_d.backward()
    loss_p = engine.train_step(x, y)
    assert_close(loss_p, loss_d.detach(), "loss")
    ref = nn.Sequential(*list(dense)[lo:hi])
    for (name, p), q in zip(stage.named_parameters(), ref.parameters(), strict=True):
        expect = q.grad if param_layout(p) is None else local_slice(q.grad, p)
        assert_close(p.grad, expect, f"grad {name}")


def test_pp_x_tp():
    run_ranks(_pp_tp, 4)


def _pp_dp() -> None:
    """PP = 2 x DP = 2: each replica pipelines its half of the batch; DDP reduces once."""
    mesh = ParallelMesh(pp=2)
    dense = nn.Sequential(*blocks(4))
    stage, (lo, hi) = build_stage(blocks(4), 2, mesh.pp_rank, costs=[1] * 6)
    ddp = DistributedDataParallel(stage, mesh=mesh)
    calls = []
    original = ddp.reducer._launch

    def counting_launch(b):
        calls.append(b.index)
        return original(b)

    ddp.reducer._launch = counting_launch
    engine = PipelineEngine(ddp, mesh, GPipe(4), loss_fn=loss_fn, no_sync=ddp.no_sync)
    x, y = batch(0, 16)
    loss_d = loss_fn(dense(x), y)
    loss_d.backward()
    half = slice(mesh.dp_rank * 8, mesh.dp_rank * 8 + 8)
    loss_p = engine.train_step(x[half], y[half], broadcast_loss=True)
    assert len(calls) == len(ddp.buckets), "gradients must be reduced once, in the last backward"
    loss_all = loss_p.clone()
    dist.all_reduce(loss_all, group=mesh.dp_group)
    assert_close(loss_all / 2, loss_d.detach(), "loss")
    for (name, p), q in zip(
        stage.named_parameters(), nn.Sequential(*list(dense)[lo:hi]).parameters(), strict=True
    ):
        assert_close(p.grad, q.grad, f"grad {name}")


def test_pp_x_dp():
    run_ranks(_pp_dp, 4)


class TiedHead(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return F.linear(x, self.weight).flatten(0, 1)


def _tied() -> tuple:
    """Embedding on stage 0, LM head sharing its weight on stage 1 (held on both)."""
    mesh = ParallelMesh(pp=2)
    torch.manual_seed(0)
    emb = nn.Embedding(V, H)
    mid = [Block(), Block()]
    dense = nn.Sequential(emb, *mid, TiedHead(emb.weight))
    torch.manual_seed(mesh.rank + 7)  # deliberately different: tie_across_stages must sync
    if mesh.is_first_stage:
        stage_emb = copy.deepcopy(emb)
        stage = nn.Sequential(stage_emb, copy.deepcopy(mid[0]))
        tied = stage_emb.weight
    else:
        tied = nn.Parameter(torch.randn(V, H))
        stage = nn.Sequential(copy.deepcopy(mid[1]), TiedHead(tied))
    tie_across_stages(tied, mesh)
    engine = PipelineEngine(stage, mesh, OneFOneB(2), loss_fn=loss_fn, tied=[tied])
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.5)
    opt_s = torch.optim.SGD(stage.parameters(), lr=0.5)
    for step in range(3):
        x, y = batch(step, 8)
        loss_d = loss_fn(dense(x), y)
        opt_d.zero_grad()
        loss_d.backward()
        opt_s.zero_grad()
        loss_p = engine.train_step(x, y)
        assert_close(loss_p, loss_d.detach(), f"loss at step {step}")
        assert_close(tied.grad, emb.weight.grad, "tied grad = embedding + head contributions")
        # the norm counts the tied weight once
        want = torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()])
        assert_close(global_grad_norm(stage.parameters(), mesh=mesh), want, "grad norm")
        opt_d.step()
        opt_s.step()
    assert_close(tied.detach(), emb.weight.detach(), "both copies took identical steps")
    return tuple(tied.detach().flatten()[:3].tolist())


def test_tied_embeddings_stay_in_sync():
    a, b = run_ranks(_tied, 2)
    assert a == b


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
    mesh = ParallelMesh(pp=2)
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
    mesh = ParallelMesh(pp=3)
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


class TupleEmbed(nn.Module):
    """ids -> (hidden, side, positions int64, keep bool, scale float without grad, None)."""

    def __init__(self):
        super().__init__()
        self.tok, self.side = nn.Embedding(V, H), nn.Embedding(V, H)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        scale = (1.0 + ids[:, :1, None].float() / V).detach()  # [B, 1, 1], requires no grad
        return (self.tok(ids), self.side(ids), pos, ids % 3 != 0, scale, None)


class TupleBlock(nn.Module):
    """Uses every slot; updates hidden, passes side (a slot requiring grad) on unchanged."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.inner, self.pos = Block(dropout=dropout), nn.Embedding(T + 3, H)

    def forward(self, msg):
        h, side, pos, keep, scale, none = msg
        assert none is None and pos.dtype == torch.int64 and keep.dtype == torch.bool
        h = self.inner(h + self.pos(pos)) * scale + side * keep.unsqueeze(-1)
        return (h, side, pos, keep, scale, none)


class TupleHead(Head):
    def forward(self, msg):
        return super().forward(msg[0] + msg[1])


def tuple_blocks(n: int = 4, dropout: float = 0.0) -> list[nn.Module]:
    torch.manual_seed(0)
    return [TupleEmbed()] + [TupleBlock(dropout) for _ in range(n)] + [TupleHead()]


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
        _pipelined, pp, schedule, m, recompute,
        make=tuple_blocks, size=12, costs=[1] * 6, measure=measure, bytes_per_step=_tuple_bytes,
    )  # fmt: skip
    if measure:  # the tensors autograd saved are counted beyond the stored stage inputs
        stored_input = 12 // m * T * H * 4 * 2 + 12 // m * T * (8 + 1) + 12 // m * 4
        assert all(peak > stored_input for peak in peaks[1:])


def _tuple_recompute_with_dropout() -> None:
    """Recomputation of tuple stages replays each forward's RNG state (including the engine's
    one extra forward that learns which output slots require grad): dropout masks match."""
    mesh = ParallelMesh(pp=2)
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
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_tuple_recompute_replays_dropout():
    run_ranks(_tuple_recompute_with_dropout, 2)


def _tuple_shapes(static: bool) -> None:
    mesh = ParallelMesh(pp=2)
    dense = nn.Sequential(*tuple_blocks(2))
    stage, (lo, hi) = build_stage(copy.deepcopy(list(dense)), 2, mesh.pp_rank)
    engine = PipelineEngine(stage, mesh, GPipe(2), loss_fn=loss_fn, static_shapes=static)
    for size, seq in ((4, T), (6, T - 2)):  # the second step changes every slot's shape
        g = torch.Generator().manual_seed(seq)
        x, y = torch.randint(0, V, (size, seq), generator=g), torch.randint(0, V, (size, seq))
        dense.zero_grad()
        loss_d = loss_fn(dense(x), y)
        loss_d.backward()
        stage.zero_grad()
        assert_close(engine.train_step(x, y), loss_d.detach(), f"loss at seq {seq}")
        ref = nn.Sequential(*list(dense)[lo:hi])
        for p, q in zip(stage.parameters(), ref.parameters(), strict=True):
            assert_close(p.grad, q.grad, f"grad at seq {seq}")


def test_tuple_shapes_may_vary_without_static_shapes():
    run_ranks(_tuple_shapes, 2, False)


def test_tuple_shape_change_under_static_shapes_is_a_clear_error():
    with pytest.raises(RankError, match=r"changed from \(\(2, 5, 16\) torch.float32 requires_grad"):
        run_ranks(_tuple_shapes, 2, True)


class BadOutput(nn.Module):
    def forward(self, ids):
        return {"hidden": ids.float()}


def _bad_output() -> None:
    mesh = ParallelMesh(pp=2)
    stage = nn.Sequential(BadOutput()) if mesh.is_first_stage else nn.Sequential(Head())
    x, y = batch(0, 4)
    PipelineEngine(stage, mesh, GPipe(2), loss_fn=loss_fn).train_step(x, y)


def test_stage_output_not_a_tensor_or_tuple_is_a_clear_error():
    with pytest.raises(RankError, match=r"must return a tensor or a tuple of tensors.*got dict"):
        run_ranks(_bad_output, 2, timeout=60)


def _tuple_inputs() -> None:
    """The first stage's inputs may be a tuple: each tensor is split into micro-batches."""
    mesh = ParallelMesh(pp=2)

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Embedding(V, H), nn.Embedding(V, H)

        def forward(self, inputs):
            return self.a(inputs[0]) + self.b(inputs[1])

    torch.manual_seed(0)
    dense = nn.Sequential(TwoInputs(), Block(), Head())
    stage, (lo, hi) = build_stage(copy.deepcopy(list(dense)), 2, mesh.pp_rank, costs=[1] * 3)
    engine = PipelineEngine(stage, mesh, OneFOneB(3), loss_fn=loss_fn)
    (x, y), (x2, _) = batch(0, 6), batch(1, 6)
    loss_d = loss_fn(dense((x, x2)), y)
    loss_d.backward()
    assert_close(engine.train_step((x, x2), y), loss_d.detach(), "loss")
    ref = nn.Sequential(*list(dense)[lo:hi])
    for p, q in zip(stage.parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, q.grad, "grad")
    with pytest.raises(ValueError, match="inputs hold 5 samples, not divisible into 3"):
        engine.train_step((x, x2[:5]), y)


def test_first_stage_takes_a_tuple_of_inputs():
    run_ranks(_tuple_inputs, 2)
