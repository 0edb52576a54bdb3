"""Planted faults at 2-4 ranks: each run fails, and the flight recorder's analysis at the end
of the launcher's error names the group, the sequence number, the op and the ranks. The
sequence numbers are counted here from what each function issues on a group of its own (the
launcher's barrier is on the default group). Plus a rank ten times slower, named by the
metrics before anything times out."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from _flags import ONE_RANK, tiny_config

from fastpar import flight
from fastpar.comm import all_to_all, gather_from_region
from fastpar.launch import RankError, run_ranks
from fastpar.mesh import ParallelMesh

TIMEOUT = 1.0  # seconds a collective waits for a peer

# each planted fault is analysed on fresh ranks: its expected findings name sequence numbers
# from a group's first collective, which the pool's live ranks are long past
pytestmark = pytest.mark.own_ranks


def _fails(fn, world: int) -> str:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(fn, world, timeout=60, collective_timeout=TIMEOUT)
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert "--- flight recorder:" in text, text[-3000:]
    return text[text.index("--- flight recorder:") :]


def _group(kind: str):
    g = dist.new_group([0, 1], timeout=dist.default_pg_timeout.__class__(seconds=TIMEOUT))
    flight.name_group(g, [kind])
    return g


def _skips_one_all_reduce():
    g, r = _group("dp"), dist.get_rank()
    for step in range(3):  # #1 all_reduce, #2 broadcast; step 1: rank 1 skips #3
        if not (r == 1 and step == 1):
            dist.all_reduce(torch.ones(4), group=g)
        dist.broadcast(torch.ones(2), dist.get_global_rank(g, 0), group=g)


def test_a_rank_that_skips_one_all_reduce():
    report = _fails(_skips_one_all_reduce, 2)
    assert (
        "first disagreement: group dp[0,1]: #3 (the ranks run different collectives): rank 0 "
        "all_reduce [4] float32; rank 1 broadcast [2] float32"
    ) in report, report


def _mismatched_splits():
    g, r = _group("ep"), dist.get_rank()
    for step in range(2):  # #1 all_reduce, #2 all_to_all, #3 all_reduce, #4 all_to_all
        dist.all_reduce(torch.ones(1), group=g)
        ins = [2, 2]
        outs = [2, 2]
        if step == 1:  # rank 0 sends 37 rows to rank 1, which expects 35 from it
            ins, outs = ([3, 37], [3, 35]) if r == 0 else ([35, 5], [35, 5])
        all_to_all(torch.ones(sum(ins), 64), g, outs, ins)


def test_all_to_all_split_sizes_that_do_not_pair_up(capfd):
    report = _fails(_mismatched_splits, 2)
    assert (
        "first disagreement: group ep[0,1]: #4 all_to_all: rank 0 sends [37, 64] to rank 1, "
        "rank 1 expects [35, 64] from rank 0"
    ) in report, report
    # gloo aborted rank 1 (it received more bytes than it expected): the abort's report is in
    # that rank's own stderr, captured here, not printed into a passing run's log
    # (tests/conftest.py points a forked rank's fatal-error report at its own stderr)
    err = capfd.readouterr().err
    assert "gloo::EnforceNotMet" in err and "Fatal Python error: Aborted" in err, err


def _tp_gather_mismatch():
    g, r = _group("tp"), dist.get_rank()
    for step in range(3):  # #1, #2, #3 all_gather; at #3 rank 1 has one more column
        gather_from_region(torch.ones(4, 5 if (r == 1 and step == 2) else 4), g, dim=0)


@pytest.mark.slow
def test_a_shape_mismatch_in_a_tp_all_gather():
    report = _fails(_tp_gather_mismatch, 2)
    first = report.splitlines()[1]
    assert first.startswith("first disagreement: group tp[0,1]: #3 all_gather: "), report
    assert (
        "rank 0 all_gather [4, 4] float32" in first and "rank 1 all_gather [4, 5] float32" in first
    )


def _other_group_order():
    mesh, r = ParallelMesh(tp=2), dist.get_rank()
    dist.all_reduce(torch.ones(2), group=mesh.tp_group)  # tp #1
    order = [mesh.tp_group, dist.group.WORLD]  # tp #2, then world #2 (#1: the barrier)
    for g in reversed(order) if r == 1 else order:
        dist.all_reduce(torch.ones(3), group=g)


@pytest.mark.slow
def test_one_rank_in_a_different_group_order():
    report = _fails(_other_group_order, 4)
    assert (
        "wait cycle: rank 0 in tp[0,1] #2 -> rank 1 in tp-dp[0,1,2,3] #2 -> rank 0: these "
        "ranks enter their groups in a different order"
    ) in report, report


def _stops():
    mesh, r = ParallelMesh(tp=2), dist.get_rank()
    for step in range(3):  # tp #1 and dp #1; then rank 2 stops before tp #2
        if r == 2 and step == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(4), group=mesh.tp_group)
        dist.all_reduce(torch.ones(4), group=mesh.dp_group)


@pytest.mark.slow
def test_a_stopped_rank():
    report = _fails(_stops, 4)
    assert (
        "first disagreement: group dp[0,2]: #2 all_reduce: rank 2 sent no dump (stopped: SIGSTOP "
        "or a debugger); waiting for it: rank 0 in dp[0,2] #2 all_reduce [4] float32, rank 3 in "
        "tp[2,3] #2 all_reduce [4] float32"
    ) in report, report
    assert "no dump from rank 2 (stopped: SIGSTOP or a debugger)" in report


def _slow_rank(cfg, tokens):
    from fastpar.train import loop
    from fastpar.train.build import Trainer

    step = Trainer.step

    def slow(self):
        t0 = time.perf_counter()
        out = step(self)
        if dist.get_rank() == 1:  # ten times this step's time
            time.sleep(9 * (time.perf_counter() - t0))
        return out

    Trainer.step = slow
    return loop.run(cfg, tokens)


@pytest.mark.slow
def test_a_rank_ten_times_slower_is_named_in_the_metrics(tmp_path, capfd):
    from fastpar.train import TrainConfig
    from fastpar.train.batches import load_data

    path = tmp_path / "m.jsonl"
    # (not quiet: the slowest rank is named in the progress lines)
    cfg = TrainConfig.from_flags(
        **tiny_config(ONE_RANK, dp=2, steps=4, log_every=1, batch_size=4, heads=2, quiet=None),
        metrics_file=str(path),
    )
    run_ranks(_slow_rank, 2, cfg, load_data(cfg), timeout=120)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows[1:]:  # the first step's times include the first-call overheads
        assert row["slowest_rank"] == 1, row
        assert row["straggle"] > 3, row
        assert row["rank_wait_s"][0] > row["rank_wait_s"][1]
    assert "slowest rank 1:" in capfd.readouterr().out


@pytest.mark.slow
def test_fastpar_flight_0_turns_the_recorder_off(monkeypatch):
    monkeypatch.setenv("FASTPAR_FLIGHT", "0")
    with pytest.raises(RankError) as info:
        run_ranks(_skips_one_all_reduce, 2, timeout=60, collective_timeout=TIMEOUT)
    assert "--- flight recorder:" not in str(info.value)
    assert "Timed out" in str(info.value)  # the failure itself, as without the recorder
