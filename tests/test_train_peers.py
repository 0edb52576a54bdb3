"""Two torchrun nodes on 127.0.0.1 (two agents, --nnodes 2, c10d rendezvous). Every rank's
resolved settings are compared before the first step: nodes started with different flags
(another --lr) stop with one error naming the setting and the ranks, instead of training apart
(under --zero 0 the replicas would end with different weights, both exiting 0). A worker whose
agent is killed (kill -9) ends within seconds instead of training on as an orphan."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from _flags import ONE_RANK, tiny_argv, tiny_config

from fastpar.launch import process_status
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig
from fastpar.train.checks import SettingsDiffer, check_same_settings

SMALL = tiny_config(ONE_RANK, batch_size=4)


def _check(lrs) -> str:
    import torch.distributed as dist

    cfg = TrainConfig.from_flags(**{**SMALL, "dp": len(lrs)})
    cfg = dataclasses.replace(cfg, lr=lrs[dist.get_rank()])
    try:
        check_same_settings(cfg)
    except SettingsDiffer as exc:
        return str(exc)
    return "agree"


def test_the_same_settings_pass_and_a_difference_names_the_flag_and_the_ranks():
    assert run_ranks(_check, 2, [3e-3, 3e-3]) == ["agree", "agree"]
    out = run_ranks(_check, 4, [3e-3, 3e-3, 1e-3, 3e-3])
    assert len(set(out)) == 1, out  # every rank says the same
    assert "--lr is 0.003 on ranks 0-1, 3; 0.001 on rank 2" in out[0], out[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(node_flags: list[list[str]], out=subprocess.PIPE) -> list[subprocess.Popen]:
    """One torchrun agent per entry (node rank = its index), one worker each, on 127.0.0.1;
    every node trains SMALL at dp 2 with its own extra flags; ``out``: where their output goes
    (a file for a job that is not read while it runs: a full pipe would block the workers)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    flags = tiny_argv(SMALL, dp=2)
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(node_flags))]
    agent += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    agent += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"nodes{port}"]
    return [
        subprocess.Popen(
            [*agent, "--node-rank", str(node), "-m", "fastpar.train", *flags, *extra],
            stdout=out,
            stderr=subprocess.STDOUT if out is not subprocess.PIPE else subprocess.PIPE,
            text=True,
            env=env,
        )
        for node, extra in enumerate(node_flags)
    ]


@pytest.mark.parametrize(
    "lr",
    [pytest.param("1e-3", marks=pytest.mark.slow), pytest.param("3e-3", marks=pytest.mark.slow)],
    ids=["other-lr", "same-lr"],
)
def test_two_torchrun_nodes_with_different_flags_stop_before_the_first_step(lr):
    """With another --lr on node 1 both end with the one-line refusal (exit 2); with the same,
    both train (exit 0)."""
    procs = _agents([["--zero", "0", "--lr", "3e-3"], ["--zero", "0", "--lr", lr]])
    outs = [p.communicate(timeout=240) for p in procs]
    codes = [p.returncode for p in procs]
    text = "\n".join(o + e for o, e in outs)
    if lr == "3e-3":
        assert codes == [0, 0], text[-3000:]
        return
    assert codes != [0, 0], text[-3000:]
    assert "--lr is 0.003 on rank 0; 0.001 on rank 1" in text, text[-3000:]
    assert "error: the ranks were started with different settings" in text
    # one line from fastpar (torchrun then reports its child's exit code as it does)
    assert not [line for line in text.splitlines() if "fastpar/train" in line], text[-3000:]


def _workers_of(agent: int) -> list[int]:
    """The fastpar.train workers ``agent`` started (not torchrun's helper processes)."""
    out = []
    for name in os.listdir("/proc"):
        status = process_status(int(name)) if name.isdigit() else None
        if status is None or status[1] != agent or status[0] == "Z":
            continue
        with contextlib.suppress(OSError), open(f"/proc/{name}/cmdline", "rb") as f:
            if b"fastpar.train" in f.read():
                out.append(int(name))
    return out


def _running(pid: int) -> bool:
    status = process_status(pid)
    return status is not None and status[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_a_worker_whose_agent_is_killed_ends_within_seconds(tmp_path):
    log = open(tmp_path / "agents.log", "w")  # noqa: SIM115  (closed below)
    procs = _agents([["--steps", "100000"], ["--steps", "100000"]], out=log)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2:  # the workers run once the rendezvous is done
            assert time.monotonic() < deadline and procs[0].poll() is None, "no worker started"
            workers = _workers_of(procs[0].pid) + _workers_of(procs[1].pid)
            time.sleep(0.2)
        time.sleep(3)  # training
        procs[0].kill()  # kill -9 of node 0's agent
        killed = time.monotonic()
        while _running(workers[0]):
            text = (tmp_path / "agents.log").read_text()[-3000:]
            assert time.monotonic() - killed < 20, f"worker {workers[0]} outlived its agent\n{text}"
            time.sleep(0.2)
        # what ended it: the watchdog (fastpar.train.peers), or, when the worker touched the
        # store first, the store's host (node 0's agent) being gone; the watchdog alone is
        # proven by test_the_agent_watchdog_ends_an_orphaned_worker
        text = (tmp_path / "agents.log").read_text()
        assert "its torchrun agent (pid" in text or "Failed to recv" in text, text[-3000:]
    finally:
        for pid in workers:  # (the pipes stay open while a worker lives)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.kill()
            p.communicate()
        log.close()


_ORPHAN = """
import os, sys, time
from fastpar.train import peers
peers.exit_with_agent(period=0.05, grace=1.0)
print("watching", flush=True)
time.sleep(60)
"""

_AGENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stderr=open(sys.argv[2], "w"),
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_the_agent_watchdog_ends_an_orphaned_worker(tmp_path):
    """A stand-in agent (the worker's parent) is killed with SIGKILL: the worker's watchdog
    names it and the worker ends (SIGTERM to itself) within seconds, nothing else touching it."""
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "watchdog-test"}
    err = tmp_path / "worker.err"
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, _ORPHAN, str(err)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    worker = None
    try:
        worker = int(agent.stdout.readline())
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 20
        while _running(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its agent"
            time.sleep(0.1)
        text = err.read_text()
        assert f"its torchrun agent (pid {agent.pid}) is gone" in text, text
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        agent.kill()
        agent.communicate()
