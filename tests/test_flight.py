"""The flight recorder's analysis as a pure function of hand-made dumps (every kind of
disagreement it names), its command ``python -m fastpar.debug analyse DIR``, and what a rank
records and dumps (group kinds, split sizes, the ring file that outlives the process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fastpar import flight
from fastpar.flight.files import main, read_dumps
from fastpar.flight.record import _where, read_ring
from fastpar.launch import run_ranks


def coll(
    group: str, seq: int, op: str, *shapes, dtype="float32", done=True, t=None, where="a.py:1 f"
):
    return {
        "group": group,
        "seq": seq,
        "op": op,
        "in": [list(s) for s in shapes],
        "in_dtypes": [dtype] * len(shapes),
        "out": [],
        "out_dtypes": [],
        "done": done,
        "t": float(seq) if t is None else t,
        "where": [where],
    }


def dump(rank, world, collectives, groups=None, ring=()):
    groups = groups or {"0": {"ranks": list(range(world)), "desc": "default_pg"}}
    return {
        "rank": rank,
        "world_size": world,
        "time": 1e6,  # after every hand-made collective began
        "groups": groups,
        "collectives": collectives,
        "ring": list(ring),
    }


def series(group: str, n: int, op="all_reduce", shape=(4,)):
    return [coll(group, s, op, shape) for s in range(1, n + 1)]


EP = {"1": {"ranks": [0, 1], "desc": "ep", "kinds": ["ep", "expert-dp-replicate"]}}


def test_agreeing_dumps_have_no_finding():
    dumps = [dump(r, 2, series("0", 5)) for r in range(2)]
    result = flight.analyse(dumps)
    assert result.first is None
    assert result.lines[0] == "the dumps show no disagreement between ranks"


def test_another_op_at_the_same_sequence_number():
    a = series("0", 3)
    b = [*series("0", 2), coll("0", 3, "broadcast", (2,))]
    result = flight.analyse([dump(0, 2, a), dump(1, 2, b)])
    assert str(result.first) == (
        "group world[0,1]: #3 (the ranks run different collectives): rank 0 all_reduce [4] "
        "float32; rank 1 broadcast [2] float32"
    )


def test_a_shape_mismatch_names_each_rank_and_the_call_sites_that_differ_earlier():
    tp = {"1": {"ranks": [0, 1], "kinds": ["tp", "mp"]}}
    a = [coll("1", s, "all_gather", (4, 8)) for s in range(1, 8)]
    b = [
        coll("1", s, "all_gather", (4, 8), where="b.py:9 g" if s == 5 else "a.py:1 f")
        for s in range(1, 7)
    ]
    b.append(coll("1", 7, "all_gather", (5, 8)))
    result = flight.analyse([dump(0, 2, a, tp), dump(1, 2, b, tp)])
    assert str(result.first) == (
        "group tp[0,1]: #7 all_gather: rank 0 all_gather [4, 8] float32; rank 1 all_gather "
        "[5, 8] float32"
    )
    assert "the ranks already differ at #5 all_gather: rank 0 at a.py:1 f; rank 1 at b.py:9 g" in (
        result.text()
    )


def _a2a(k, ins, outs, rows):
    return {
        "kind": "collective",
        "group": "1",
        "k": k,
        "n": k,
        "op": "all_to_all",
        "shape": [rows, 64],
        "dtype": "float32",
        "in_splits": ins,
        "out_splits": outs,
    }


def test_all_to_all_split_sizes_that_do_not_pair_up():
    # rank 0 sends 37 rows to rank 1, which expects 35 from it (its own 3 + 37 = 40 rows)
    a = [coll("1", 417, "all_to_all", (4, 64)), coll("1", 418, "all_to_all", (40, 64))]
    b = [coll("1", 417, "all_to_all", (4, 64)), coll("1", 418, "all_to_all", (40, 64))]
    ring0 = [_a2a(1, [2, 2], [2, 2], 4), _a2a(2, [3, 37], [3, 35], 40)]
    ring1 = [_a2a(1, [2, 2], [2, 2], 4), _a2a(2, [35, 5], [35, 5], 40)]
    result = flight.analyse([dump(0, 2, a, EP, ring0), dump(1, 2, b, EP, ring1)])
    assert str(result.first) == (
        "group ep[0,1]: #418 all_to_all: rank 0 sends [37, 64] to rank 1, rank 1 expects "
        "[35, 64] from rank 0"
    )


def test_a_rank_that_never_arrived_and_how_far_behind_it_is():
    a = series("0", 418)
    b = series("0", 417)
    result = flight.analyse([dump(0, 2, a), dump(1, 2, b)])
    assert str(result.first) == (
        "group world[0,1]: #418 all_reduce: rank 0 is in it, rank 1 never arrived (its last "
        "here: #417 all_reduce)"
    )
    assert "group world[0,1]: behind #418: rank 1 by 1" in result.lines


def test_a_rank_dumped_before_the_others_entered_a_collective_is_not_said_to_miss_it():
    """A live run's ranks are dumped moments apart (SIGUSR1 to the launcher): a dump taken
    before any rank entered #418 cannot show its rank missing #418; one taken after can."""
    a, b = series("0", 418), series("0", 417)  # #418 began at t=418
    early = flight.analyse([dump(0, 2, a), dump(1, 2, b) | {"time": 417.5}])
    assert early.first is None and "the dumps show no disagreement between ranks" in early.lines
    assert "group world[0,1]: behind #418: rank 1 by 1" in early.lines
    late = flight.analyse([dump(0, 2, a), dump(1, 2, b) | {"time": 418.5}])
    assert "rank 1 never arrived (its last here: #417 all_reduce)" in str(late.first)


def test_a_rank_without_a_dump_is_named_with_what_the_launcher_knows():
    groups = {"1": {"ranks": [0, 1], "kinds": ["tp"]}, "0": {"ranks": [0, 1, 2]}}
    a = [coll("1", 1, "all_reduce", (4,)), coll("1", 2, "all_reduce", (4,), done=False)]
    result = flight.analyse([dump(0, 3, a, groups), dump(2, 3, [], groups)], known={1: "stopped"})
    assert str(result.first) == (
        "group tp[0,1]: #2 all_reduce: rank 1 sent no dump (stopped); waiting for it: rank 0 in "
        "tp[0,1] #2 all_reduce [4] float32"
    )
    assert "no dump from rank 1 (stopped)" in result.lines


def test_a_dead_ranks_ring_file_gives_its_side():
    tp = {"1": {"ranks": [0, 1], "kinds": ["tp"]}}
    a = [coll("1", 1, "all_gather", (4, 4)), coll("1", 2, "all_gather", (4, 5))]
    note = dict(kind="collective", group="1", op="all_gather", dtype="float32")
    ring1 = [note | {"k": 1, "n": 1, "shape": [4, 4]}, note | {"k": 2, "n": 2, "shape": [4, 4]}]
    ring0 = [note | {"k": 1, "n": 1, "shape": [4, 4]}, note | {"k": 2, "n": 2, "shape": [4, 5]}]
    dead = {"rank": 1, "partial": True, "ring": ring1}
    result = flight.analyse([dump(0, 2, a, tp, ring0), dead], known={1: "died of SIGABRT"})
    assert str(result.first) == (
        "group tp[0,1]: #2 all_gather: rank 0 all_gather [4, 5] float32; rank 1 all_gather "
        "[4, 4] float32 (rank 1's from its ring file: it died of SIGABRT)"
    )


def test_ranks_waiting_in_a_cycle():
    groups = {
        "0": {"ranks": [0, 1, 2, 3]},
        "1": {"ranks": [0, 1], "kinds": ["tp"]},
        "2": {"ranks": [2, 3], "kinds": ["tp"]},
    }
    first = coll("1", 1, "all_reduce", (2,), t=0.0)
    r0 = [first, coll("1", 2, "all_reduce", (3,), t=1.0, done=False)]
    r1 = [first, coll("0", 1, "all_reduce", (3,), t=1.0, done=False)]
    r23 = [coll("2", 1, "all_reduce", (3,), t=0.5), coll("0", 1, "all_reduce", (3,), t=1.0)]
    dumps = [dump(0, 4, r0, groups), dump(1, 4, r1, groups)]
    dumps += [dump(r, 4, r23, groups) for r in (2, 3)]
    result = flight.analyse(dumps)
    assert result.lines[0] == (
        "wait cycle: rank 0 in tp[0,1] #2 -> rank 1 in world[0,1,2,3] #1 -> rank 0: these "
        "ranks enter their groups in a different order"
    )


def test_pipeline_messages_that_do_not_match():
    send = {"kind": "send", "peer": 1, "k": 3, "shape": [4, 16], "dtype": "float32"}
    recv = {"kind": "recv", "peer": 0, "k": 3, "shape": [4, 32], "dtype": "float32"}
    result = flight.analyse([dump(0, 2, [], ring=[send]), dump(1, 2, [], ring=[recv])])
    assert (
        "p2p 0->1: message #3: rank 0 sends [4, 16] float32, rank 1 receives [4, 32] float32"
        in result.lines
    )


def test_the_analyse_command_reads_a_directory(tmp_path, capsys):
    a, b = series("0", 3), series("0", 2)
    for d in (dump(0, 2, a), dump(1, 2, b)):
        (tmp_path / f"flight_rank{d['rank']}.json").write_text(json.dumps(d))
    assert main(["analyse", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 dumps in" in out and "group world[0,1]: #3 all_reduce: rank 0 is in it" in out


@pytest.mark.slow
def test_python_m_fastpar_debug_analyse(tmp_path):
    for d in (dump(0, 2, series("0", 3)), dump(1, 2, series("0", 2))):
        (tmp_path / f"flight_rank{d['rank']}.json").write_text(json.dumps(d))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "fastpar.debug", "analyse", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0 and "rank 1 never arrived" in run.stdout, run.stderr


def _record(directory):
    g = dist.new_group([0, 1])
    flight.name_group(g, ["ep"])
    flight.arm(directory, dist.get_rank())
    from fastpar.comm import all_to_all

    ins = [1, 3] if dist.get_rank() == 0 else [3, 1]
    out = all_to_all(torch.ones(4, 2), g, ins, ins)
    dist.all_reduce(out, group=g)
    return flight.dump(directory, "asked")


def test_a_rank_records_groups_splits_and_leaves_a_ring_file(tmp_path):
    paths = run_ranks(_record, 2, str(tmp_path), timeout=60)
    assert paths == [str(tmp_path / f"flight_rank{r}.json") for r in range(2)]
    d = {x["rank"]: x for x in read_dumps(str(tmp_path))}[1]
    assert d["reason"] == "asked" and d["torch_recorder"]
    name = next(n for n, g in d["groups"].items() if g.get("kinds") == ["ep"])
    assert d["groups"][name]["ranks"] == [0, 1]
    ops = [(c["seq"], c["op"]) for c in d["collectives"] if c["group"] == name]
    assert ops == [(1, "all_to_all"), (2, "all_reduce")]
    ring = read_ring(str(tmp_path / "ring_rank1.bin"))
    assert [(n["op"], n["in_splits"], n["out_splits"]) for n in ring] == [
        ("all_to_all", [3, 1], [3, 1])
    ]


def _pipeline_step(cfg, tokens, directory):
    from fastpar.mesh import ParallelMesh
    from fastpar.train.build import Trainer

    flight.arm(directory, dist.get_rank())
    trainer = Trainer(cfg, ParallelMesh(cfg.tp, cfg.pp, cfg.ep), torch.device("cpu"), tokens)
    trainer.step()
    return flight.dump(directory, "after a step")


@pytest.mark.slow
def test_a_pipeline_records_its_sends_and_receives(tmp_path):
    from fastpar.train import TrainConfig
    from fastpar.train.batches import load_data

    cfg = TrainConfig.from_flags(
        tp=1, pp=2, dp=1, ep=1, moe_every=0, microbatches=2, steps=1, quiet=True
    )
    run_ranks(_pipeline_step, 2, cfg, load_data(cfg), str(tmp_path), timeout=120)
    dumps = {d["rank"]: d for d in read_dumps(str(tmp_path))}
    sent = [
        (n["k"], n["shape"]) for n in dumps[0]["ring"] if n["kind"] == "send" and n["peer"] == 1
    ]
    got = [(n["k"], n["shape"]) for n in dumps[1]["ring"] if n["kind"] == "recv" and n["peer"] == 0]
    assert sent and sent == got  # every message rank 0 sent, rank 1 received alike
    assert not any(line.startswith("p2p") for line in flight.analyse(list(dumps.values())).lines)


_USR1_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from fastpar.testing import run_ranks

def fn(marker):
    for _ in range(4):  # the default group's #2-#5 (#1: run_ranks' barrier)
        dist.all_reduce(torch.ones(4))
    # at rest, past #5 and in no collective, until the parent has its report: the dumps are of
    # one known point however loaded the machine is
    open(f"{marker}.{dist.get_rank()}", "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(marker + ".done") and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(3):  # the run goes on: its collectives still work
        dist.all_reduce(torch.ones(4))
    return dist.get_rank()

print(run_ranks(fn, 2, sys.argv[1], timeout=600), flush=True)
"""


def test_sigusr1_to_the_caller_prints_every_ranks_analysis_and_the_run_goes_on(tmp_path):
    """SIGUSR1 to the process that started the ranks (``python -m fastpar.train`` alike): each
    live rank dumps, the caller prints the analysis to stderr, and the run still ends well
    (without the handler SIGUSR1's default action ends the caller). The ranks wait at a known
    point while it is sent; ranks caught between two collectives are
    ``test_a_rank_dumped_before_the_others_entered_a_collective_is_not_said_to_miss_it``'s."""
    import signal
    import time

    marker = str(tmp_path / "running")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _USR1_SCRIPT, marker], stdout=out, stderr=err
        )
        try:
            deadline = time.monotonic() + 300  # (generous: starting torch on a loaded machine)
            at_rest = [f"{marker}.{r}" for r in range(2)]
            while not all(map(os.path.exists, at_rest)) and time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
            assert all(map(os.path.exists, at_rest)), (tmp_path / "err").read_text()
            proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 120
            while "flight recorder" not in (tmp_path / "err").read_text():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            open(marker + ".done", "w").close()
            assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert (tmp_path / "out").read_text().strip() == "[0, 1]"
    text = (tmp_path / "err").read_text()
    assert "--- flight recorder: 2 dumps in" in text, text
    assert "the dumps show no disagreement between ranks" in text, text
    for r in range(2):
        assert f"rank {r} is last in world[0,1] #5 all_reduce [4] float32\n" in text, text


def test_where_a_collective_comes_from_skips_the_modules_it_passes_through():
    torch_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "c10d.py")
    frames = [
        {"filename": torch_file, "line": 1, "name": "all_reduce"},
        {"filename": "/src/fastpar/comm/plain.py", "line": 20, "name": "all_reduce"},
        {"filename": "/src/fastpar/train/metrics.py", "line": 7, "name": "resolve"},
        {"filename": "/src/fastpar/train/loop.py", "line": 9, "name": "run"},
    ]
    assert _where(frames) == ["train/metrics.py:7 resolve", "train/loop.py:9 run"]
