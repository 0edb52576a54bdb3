"""Interleaved 1F1B (v model chunks per rank, placed round-robin) equals the unpipelined model:
losses and every gradient, pp 2 and 4, v 2 and 4, m = p, 2p, 3p, with and without
recomputation, tensor and tuple messages, micro-batch groups of p and larger (Megatron's
microbatch_group_size_per_vp_stage, m then not always a multiple of p); the schedule's order,
bubble (with and without message latency) and errors.

Pipelined against unpipelined results are judged by ``fastpar.tolerance``'s rule (micro-batch
sums are not the whole batch's: ``dense_references`` / ``check_step`` of tests/_pipeline.py)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from _flags import argv, tiny_config
from _mesh import make_mesh
from _pipeline import batch, blocks, check_step, dense_references, loss_fn, tuple_blocks

from fastpar.parallel.pipeline import (
    GPipe,
    Interleaved,
    OneFOneB,
    PipelineEngine,
    build_virtual_stages,
    make_schedule,
)
from fastpar.testing import RankError, run_ranks


def _interleaved(
    v: int, m: int, recompute: bool, n: int, refs, make=blocks, size: int = 24, group=None
) -> list:
    """Two SGD steps pipelined over v chunks per rank: at each step the unpipelined model's
    loss, and every chunk parameter's gradient that of the whole model's parameter of the same
    global name (``refs``: ``dense_references(lambda: make(n), 2, size)``)."""
    mesh = make_mesh(pp="world")
    blocks_ = make(n)
    chunks, ranges = build_virtual_stages(
        blocks_, mesh.pp_size, mesh.pp_rank, v, costs=[1] * len(blocks_)
    )
    sched = Interleaved(m, v, group)
    engine = PipelineEngine(chunks, mesh, sched, loss_fn=loss_fn, recompute=recompute)
    opt_s = torch.optim.SGD(chunks.parameters(), lr=0.5)
    for step in range(2):
        x, y = batch(step, size)
        opt_s.zero_grad()
        loss_p = engine.train_step(x, y)
        grads = [(name, p.grad) for name, p in chunks.named_parameters()]
        check_step(refs, step, loss_p, grads, f"rank {mesh.pp_rank}, step {step + 1}: ")
        opt_s.step()
    assert engine.stats["max_in_flight"] == sched.max_in_flight(mesh.pp_size, mesh.pp_rank)
    return ranges


def _refs(n: int, make=blocks, size: int = 24):
    return dense_references(functools.partial(make, n), 2, size)


@pytest.mark.parametrize(
    "pp, v, m, recompute",
    [
        (2, 2, 2, False),
        (2, 2, 4, True),
        (2, 2, 6, False),
        (2, 4, 4, False),
        (2, 4, 6, True),
        (4, 2, 4, False),
        (4, 2, 8, True),
        (4, 2, 12, False),
    ],
)
def test_interleaved_equals_unpipelined(pp, v, m, recompute):
    n = pp * v - 2 + (1 if m == 6 else 0)  # exactly p*v blocks, or one more (uneven chunks)
    ranges = run_ranks(_interleaved, pp, v, m, recompute, n, _refs(n))
    # round-robin placement: rank r holds chunks r, r + p, ...: together every block once
    flat = sorted(r for rank in ranges for r in rank)
    assert flat[0][0] == 0 and flat[-1][1] == n + 2
    assert all(a[1] == b[0] for a, b in itertools.pairwise(flat))
    assert all(ranges[r][c] == flat[c * pp + r] for r in range(pp) for c in range(v))


def test_interleaved_tuple_messages_equal_unpipelined():
    run_ranks(
        _interleaved, 2, 2, 4, True, 4, _refs(4, tuple_blocks, 12), make=tuple_blocks, size=12
    )


@pytest.mark.parametrize(
    "pp, v, m, group, recompute",
    [
        (2, 2, 8, 4, False),
        (2, 2, 5, 3, True),  # m not a multiple of p: groups of 3 and 2
        (2, 4, 6, 4, False),  # groups of 4 and 2
        (4, 2, 12, 8, False),  # groups of 8 and 4
        (4, 2, 8, 8, True),
    ],
)
def test_larger_micro_batch_groups_equal_unpipelined(pp, v, m, group, recompute):
    n = pp * v - 2
    run_ranks(_interleaved, pp, v, m, recompute, n, _refs(n, size=4 * m), size=4 * m, group=group)


def test_larger_groups_follow_megatrons_table_and_absorb_latency():
    # Megatron-Core's get_schedule_table(m=5, v=2, group=3) written out: micro-batches 0-2
    # through chunk 0 then chunk 1, then the last group (3, 4) the same way
    table = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    p, v, m, g = 2, 2, 5, 3
    for r in range(p):
        steps = Interleaved(m, v, g).steps(p, r)
        assert [(i, c) for kind, i, c in steps if kind == "F"] == table
        assert [(i, c) for kind, i, c in steps if kind == "B"] == [(i, 1 - c) for i, c in table]
        warm = next(k for k, s in enumerate(steps) if s[0] == "B") - 1
        assert warm == (p - r - 1) * 2 + (v - 1) * g  # 5 on rank 0, 3 on rank 1
    for p in (2, 3, 4):  # every valid group size: no deadlock, the textbook bubble
        for v in (2, 3):
            for m in range(p, 13):
                for g in (g for g in range(p, m + 1) if not 0 < m % g < p):
                    got = Interleaved(m, v, g).bubble_fraction(p)
                    assert got == pytest.approx((p - 1) / (v * m + p - 1)), (p, v, m, g)
    for p, v, m in ((2, 2, 8), (2, 4, 8), (4, 2, 8), (4, 4, 16)):
        base, wide = Interleaved(m, v), Interleaved(m, v, 2 * p)
        chunk = (1 / v, 2 / v)  # a stage's forward is 1: a chunk's is 1 / v
        # free messages: the same bubble, the textbook one
        assert wide.bubble_fraction(p, *chunk) == pytest.approx(base.theory(p))
        assert base.bubble_fraction(p, *chunk) == pytest.approx(base.theory(p))
        # messages taking 5 % of a stage's forward: groups of p pay it on every step of the
        # ring, groups of 2p only at the ends
        slow, slack = (s.bubble_fraction(p, *chunk, latency=0.05) for s in (base, wide))
        assert slack < slow and slack < 1.15 * base.theory(p), (p, v, m, slow, slack)
        # the price: (v - 1)(g - p) more chunk-forwards in flight on every rank
        for r in range(p):
            extra = wide.max_in_flight(p, r) - base.max_in_flight(p, r)
            assert extra == (v - 1) * p, (p, v, m, r)


def test_interleaved_order_is_megatrons():
    # Megatron-Core's interleaved order: the k-th forward runs chunk (k // p) % v of
    # micro-batch (k // (p v)) p + k % p; warm-up (p - r - 1) * 2 + (v - 1) * p forwards
    p, v, m = 4, 2, 8
    for r in range(p):
        steps = Interleaved(m, v).steps(p, r)
        fwd = [(i, c) for kind, i, c in steps if kind == "F"]
        assert fwd == [((k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]
        bwd = [(i, c) for kind, i, c in steps if kind == "B"]
        assert bwd == [((k // (p * v)) * p + k % p, v - 1 - (k // p) % v) for k in range(m * v)]
        warm = next(k for k, s in enumerate(steps) if s[0] == "B") - 1
        assert warm == min((p - r - 1) * 2 + (v - 1) * p, m * v)
    for p in (2, 4):
        for v in (2, 4):
            for m in (p, 2 * p, 4 * p):
                sched = Interleaved(m, v)
                assert sched.bubble_fraction(p) == pytest.approx((p - 1) / (v * m + p - 1))
                assert sched.bubble_fraction(p) < OneFOneB(m).bubble_fraction(p)


def test_interleaved_timeline_and_schedule_names():
    text = Interleaved(4, 2).timeline(2)
    assert text.splitlines()[1].startswith("rank 0: F0.0 F1.0 F0.1 F1.1 F2.0")
    assert isinstance(make_schedule("interleaved", 4, 2), Interleaved)
    assert isinstance(make_schedule("gpipe", 4), GPipe)
    with pytest.raises(ValueError, match="virtual_stages 2 needs the interleaved schedule"):
        make_schedule("1f1b", 4, 2)


def test_impossible_combinations_are_clear_errors():
    with pytest.raises(ValueError, match=r"micro-batches \(6\) to be a multiple of the pipeline"):
        Interleaved(6, 2).steps(4, 0)
    with pytest.raises(ValueError, match="group_size 2 is smaller than the pipeline size 4"):
        Interleaved(8, 2, 2).check(4)
    with pytest.raises(ValueError, match=r"must be an integer in \[pp, num_microbatches = 8\]"):
        Interleaved(8, 2, 9)
    with pytest.raises(ValueError, match="leave a last group of 1, fewer than the pipeline"):
        Interleaved(7, 2, 3).check(2)
    with pytest.raises(ValueError, match="with 1 virtual stage there are none to order"):
        Interleaved(8, 1, 4)
    with pytest.raises(ValueError, match="group_size 4 needs the interleaved schedule"):
        make_schedule("1f1b", 8, 1, 4)
    with pytest.raises(ValueError, match="needs pp > 1"):
        Interleaved(4, 2).check(1)
    with pytest.raises(ValueError, match="virtual_stages must be a positive integer"):
        Interleaved(4, 0)
    with pytest.raises(ValueError, match=r"needs 8 chunks of at least one block each"):
        build_virtual_stages(blocks(4), 4, 0, 2)


def _wrong_chunks() -> None:
    mesh = make_mesh(pp=2)
    chunks, _ = build_virtual_stages(blocks(4), 2, mesh.pp_rank, 3)
    PipelineEngine(chunks, mesh, Interleaved(4, 2), loss_fn=loss_fn)


def test_chunk_count_must_match_the_schedule():
    with pytest.raises(RankError, match="runs 2 model chunks per rank but the stage holds 3"):
        run_ranks(_wrong_chunks, 2)


# -- composed with the data-parallel family, through the trainer -------------------------------
def _pp_dp_interleaved(refs) -> None:
    """PP 2 x DP 2, two chunks a rank under fastpar's DDP: every bucket is reduced exactly once
    (in the last backward; the other chunks' accumulated gradients count as theirs) and every
    gradient equals the whole model's."""
    from fastpar.parallel import DistributedDataParallel

    mesh = make_mesh(pp=2)
    chunks, _ = build_virtual_stages(blocks(4), 2, mesh.pp_rank, 2)
    ddp = DistributedDataParallel(chunks, mesh=mesh, find_unused_parameters=True)
    calls = []
    original = ddp.reducer._launch
    ddp.reducer._launch = lambda b: (calls.append(b.index), original(b))[1]
    engine = PipelineEngine(chunks, mesh, Interleaved(4, 2), loss_fn=loss_fn, grad_sync=ddp)
    x, y = batch(0, 16)
    half = slice(mesh.dp_rank * 8, mesh.dp_rank * 8 + 8)
    engine.train_step(x[half], y[half])
    assert sorted(calls) == list(range(len(ddp.buckets))), "each bucket reduced once"
    grads = [(name, p.grad) for name, p in chunks.named_parameters()]
    check_step(refs, 0, None, grads, f"rank {mesh.rank}: ")


def test_pp_x_dp_interleaved_reduces_every_gradient_once():
    run_ranks(_pp_dp_interleaved, 4, _refs(4, size=16))


SMALL = tiny_config(steps=3)


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=1, pp=4, dp=1, ep=1, zero=0, virtual_stages=2, microbatches=4)
        | dict(layers=6, recompute=True),
        dict(tp=1, pp=2, dp=2, ep=2, zero=2, virtual_stages=3, microbatches=4, layers=4),
        dict(tp=1, pp=2, dp=2, ep=2, zero=1, virtual_stages=2, microbatches=5)
        | dict(microbatch_group_size=3, batch_size=10),
    ],
    ids=[  # (tp 2 x pp 2 x dp 2 x ep 2, v 2, m 2: tests/test_verify_matrix.py)
        "pp4-z0-v2-recompute",
        "pp2-dp2-ep2-z2-v3",
        "pp2-dp2-ep2-z1-v2-m5-g3",
    ],
)
def test_verify_interleaved_agrees_with_single_process(layout):
    """The trainer's interleaved run (losses, grad norms, parameters after the steps through a
    checkpoint) equals the single-process model, composed with TP, DP, EP and ZeRO."""
    from fastpar.train import TrainConfig
    from fastpar.verify import compare

    ok, text = compare(TrainConfig.from_flags(**{**SMALL, **layout, "schedule": "interleaved"}))
    assert ok, text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
        (
            argv(schedule="interleaved", virtual_stages=2, microbatches=3, batch_size=12),
            "needs --microbatches (3) to be a multiple of --pp 2",
        ),
        (
            ["--schedule", "interleaved", "--virtual-stages", "4", "--layers", "4"],
            "--pp 2 x --virtual-stages 4 needs 8 model chunks",
        ),
        (
            ["--schedule", "interleaved", "--virtual-stages", "2", "--zero", "3"],
            "--schedule interleaved with --zero 3 is not supported",
        ),
        (["--schedule", "interleaved", "--pp", "1", "--dp", "4"], "needs --pp 2 or more"),
        (["--schedule", "zb"], "schedule must be one of gpipe, 1f1b, interleaved"),
        (["--microbatch-group-size", "2"], "--microbatch-group-size 2 orders the model chunks"),
        (
            argv(schedule="interleaved", virtual_stages=2, microbatches=4, microbatch_group_size=3),
            "leave a last group of 1, fewer than the pipeline",
        ),
        (
            argv(schedule="interleaved", virtual_stages=2, microbatches=4, microbatch_group_size=0),
            "--microbatch-group-size 0 must be >= 1",
        ),
    ],
)
def test_cli_refuses_impossible_interleaved_runs(argv, message, capsys, monkeypatch):
    from _no_ranks import forbid_ranks

    from fastpar.train import main

    forbid_ranks(monkeypatch)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
