"""One writer per checkpoint directory (``fastpar.checkpoint.lock``): a live holder refused by
name, a released lock free, a dead holder's lock taken over (another host's once its heartbeat
goes stale), and two real runs into one directory: the second refused naming the first's rank
0, a --resume after kill -9 of the first taking its lock over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from _checkpoint_runs import run, steps
from _flags import ONE_RANK, tiny_argv

from fastpar.checkpoint.directory import scan
from fastpar.checkpoint.lock import DirectoryLock, LockHeld
from fastpar.testing import RankError


def test_a_live_holder_is_refused_by_name_and_a_released_lock_is_free(tmp_path):
    first = DirectoryLock(str(tmp_path), "run-one")
    assert first.acquire() is None and not first.taken_over
    second = DirectoryLock(str(tmp_path), "run-two")
    pid, host = os.getpid(), socket.gethostname()
    with pytest.raises(LockHeld, match=rf"locked by run 'run-one' \(pid {pid} on host {host}"):
        second.acquire()
    first.release()
    previous = second.acquire()
    assert previous["run_id"] == "run-one" and previous["released"] and not second.taken_over
    second.release()


def _dead_pid() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def _write_lock(directory, **content) -> None:
    now = time.time()
    record = dict(
        host=socket.gethostname(),
        pid=_dead_pid(),
        run_id="old",
        started=now,
        heartbeat=now,
        released=False,
        token="theirs",
    )
    with open(os.path.join(directory, "LOCK"), "w") as f:
        json.dump({**record, **content}, f)


def test_a_dead_holders_lock_is_taken_over_and_other_hosts_go_stale(tmp_path):
    d = str(tmp_path)
    _write_lock(d)  # a writer on this host that died without releasing (kill -9)
    lock = DirectoryLock(d, "new")
    assert lock.acquire()["run_id"] == "old" and lock.taken_over
    lock.release()
    # another host: its process cannot be seen; a fresh heartbeat is refused, a stale one taken
    _write_lock(d, host="elsewhere.invalid", pid=1)
    with pytest.raises(LockHeld, match=r"on host elsewhere\.invalid.*runs on another host"):
        DirectoryLock(d, "new", stale_after_s=60).acquire()
    _write_lock(d, host="elsewhere.invalid", pid=1, heartbeat=time.time() - 120)
    lock = DirectoryLock(d, "new", stale_after_s=60)
    assert lock.acquire()["host"] == "elsewhere.invalid" and lock.taken_over
    _write_lock(d, host="elsewhere.invalid", pid=1)  # ... which took it back meanwhile
    with pytest.raises(LockHeld, match=r"lost the lock .* run 'old' \(pid 1 on host elsewhere"):
        lock.check()
    lock.release()


def test_two_runs_into_one_directory(tmp_path, capfd):
    """A run writing a checkpoint every step; a second run into its directory is refused,
    naming the first's rank 0; after kill -9 of the first, a --resume takes its lock over and
    goes on from its newest complete checkpoint."""
    d = str(tmp_path / "ckpt")
    flags = tiny_argv(
        ONE_RANK,
        steps=100000,
        save_every=1,
        batch_size=4,
        microbatches=1,
        lr_schedule="constant",
        checkpoint_dir=d,
    )
    first = subprocess.Popen(
        [sys.executable, "-m", "fastpar.train", *flags],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(e.status == "complete" for e in scan(d)):
            assert first.poll() is None, first.stderr.read().decode()
            assert time.monotonic() < deadline, "the first run saved nothing in 120 s"
            time.sleep(0.2)
        with open(os.path.join(d, "LOCK")) as f:
            holder = json.load(f)
        with open(f"/proc/{holder['pid']}/stat") as f:  # the first run's rank 0
            assert int(f.read().rpartition(")")[2].split()[1]) == first.pid
        with pytest.raises(
            RankError,
            match=rf"locked by run '{holder['run_id']}' \(pid "
            rf"{holder['pid']} on host",
        ):
            run(checkpoint_dir=d, allow_other_run=True)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    while os.path.exists(f"/proc/{holder['pid']}"):
        time.sleep(0.05)
    done = [e for e in scan(d) if os.path.exists(os.path.join(e.path, "COMPLETE"))]
    newest = done[-1].step
    capfd.readouterr()
    # (constant: fewer --steps move no LR, so the resume needs no --allow-schedule-change)
    resumed = run(checkpoint_dir=d, resume=True, steps=newest + 1, lr_schedule="constant")
    err = capfd.readouterr().err
    assert f"taking over the lock of run '{holder['run_id']}' (pid {holder['pid']}" in err
    assert steps(resumed) == [newest + 1]
