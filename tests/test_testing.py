"""The multi-rank harness itself: results, errors with rank and traceback, timeouts, no clashes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh
from _procs import alive, children, kill_all

from fastpar.mesh.check import group_sums
from fastpar.testing import RankError, RankTimeout, run_ranks


def _sum_ranks(scale, *, offset=0.0):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return (
        dist.get_rank(),
        dist.get_world_size(),
        float(t.item()) * scale + offset,
        os.environ["RANK"],
    )


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_results_in_rank_order(world):
    out = run_ranks(_sum_ranks, world, 2.0, offset=1.0)
    total = world * (world + 1) / 2
    assert out == [(r, world, total * 2.0 + 1.0, str(r)) for r in range(world)]


def test_closures_and_unpicklable_arguments_work_with_fork():
    lock = threading.Lock()  # neither a lock nor a lambda can be pickled; fork needs neither

    def work(lk):
        with lk:
            return 3 + dist.get_rank()

    assert run_ranks(lambda: work(lock), 2) == [3, 4]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("bad shape (3, 5): expected (3, 4)")
    dist.barrier()  # rank 0 would wait here forever without the harness
    return "unreachable"


def test_exception_names_rank_and_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_fail_on_rank_one, 4, timeout=60)
    err = info.value
    assert err.rank == 1
    assert isinstance(err.exception, ValueError)
    assert "rank 1 of 4 raised ValueError: bad shape (3, 5)" in str(err)
    assert "_fail_on_rank_one" in err.remote_traceback
    assert not isinstance(err, RankTimeout)
    # the waiting ranks were killed, not left to the 60 s timeout
    assert time.monotonic() - t0 < 30


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)
    return "done"


def test_timeout_kills_every_rank_and_shows_where_it_hung():
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang_on_rank_zero, 2, timeout=3)
    msg = str(info.value)
    assert "ranks [0] of 2 did not finish within 3 s" in msg
    assert "_hang_on_rank_zero" in msg  # the stack dump of the hung rank


def _die():
    if dist.get_rank() == 1:
        os._exit(7)
    return 0


def test_rank_that_dies_without_result():
    with pytest.raises(RankError, match=r"rank 1 exited \(code 7\) without a result"):
        run_ranks(_die, 2, timeout=30)


def test_back_to_back_runs_do_not_clash():
    for world in (2, 3, 2, 4):
        assert run_ranks(lambda: dist.get_world_size(), world) == [world] * world


@pytest.mark.slow  # two pytest processes: about 6 s
def test_parallel_runs_in_separate_processes_do_not_clash():
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from fastpar.testing import run_ranks
        def f():
            t = torch.ones(1); dist.all_reduce(t); return t.item()
        for _ in range(5):
            assert run_ranks(f, 4) == [4.0] * 4
        print("ok")
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == "ok"


@pytest.mark.slow
def test_spawn_start_method():
    out = run_ranks(group_sums, 2, 2, 1, 1, "tp-ep-dp-pp", start_method="spawn", timeout=120)
    assert out[0]["tp"] == ([0, 1], 3) and out[1]["tp"] == ([0, 1], 3)


def _matmul():
    x = torch.randn(300, 300)
    return torch.get_num_threads(), bool(torch.isfinite(x @ x).all())


def test_fork_after_parent_used_its_thread_pool():
    # GNU libgomp hangs a forked child that starts a pool after the parent used one; forked
    # ranks therefore run single-threaded. Use the pool in the parent first, then fork.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        a = torch.randn(1000, 1000)
        assert torch.isfinite(a @ a).all()
        assert run_ranks(_matmul, 1, timeout=30) == [(1, True)]
        assert run_ranks(_matmul, 2, timeout=30) == [(1, True), (1, True)]
    finally:
        torch.set_num_threads(threads)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        run_ranks(_sum_ranks, 0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        run_ranks(_sum_ranks, 2, timeout=0)
    with pytest.raises(ValueError, match="GNU libgomp is not fork-safe"):
        run_ranks(_sum_ranks, 2, threads_per_rank=2)


def _many_tensors():
    return [torch.full((100, 100), float(dist.get_rank() + i)) for i in range(20)]


def test_returned_tensors_survive_the_rank_exiting():
    # tensors must be copied, not passed through shared memory that dies with the rank
    for _ in range(5):
        out = run_ranks(_many_tensors, 2)
        assert [t[0, 0].item() for t in out[1]] == [float(1 + i) for i in range(20)]


# -- ranks never outlive the caller; signals; ranks that never answer ---------------------------
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's"
)


def _stop_rank_two():
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))


@linux_only
def test_error_names_the_rank_that_never_answered():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_stop_rank_two, 3, timeout=60, collective_timeout=2)
    assert time.monotonic() - t0 < 30
    assert "no answer from rank 2 (its process is stopped: SIGSTOP or a debugger)" in str(
        info.value
    )
    assert info.value.rank in (0, 1)


def _rank_pids(parent: int, world: int, deadline: float) -> dict[str, int]:
    """{"fastpar-rank<N>": pid} of ``parent``'s children, once all ``world`` of them run."""
    while time.monotonic() < deadline:
        ranks = {n: p for p, (n, _) in children(parent).items() if n.startswith("fastpar-rank")}
        if len(ranks) == world:
            return ranks
        time.sleep(0.1)
    raise AssertionError(f"the ranks of {parent} did not appear: {children(parent)}")


_SLEEPER = """
import sys, time, signal, torch.distributed as dist
from fastpar.testing import run_ranks

def work(path):
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    open(f"{path}.ready{dist.get_rank()}", "w").close()
    while not stop:
        time.sleep(0.05)
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        f.write("stopped cleanly")
    return dist.get_rank()

if sys.argv[2] == "catch":  # a caller that handles SIGTERM itself gets the results
    signal.signal(signal.SIGTERM, lambda *a: print("caller saw SIGTERM", flush=True))
print(run_ranks(work, 2, sys.argv[1], timeout=120), flush=True)
"""


@contextlib.contextmanager
def _sleeper(tmp_path, mode):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLEEPER, str(tmp_path / "flag"), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = {}
    try:
        pids = _rank_pids(proc.pid, 2, time.monotonic() + 60)
        yield proc, pids
    finally:
        kill_all([*pids.values(), proc.pid])
        proc.wait(timeout=30)


@linux_only
def test_ranks_die_with_the_caller_even_by_sigkill(tmp_path):
    with _sleeper(tmp_path, "default") as (proc, pids):
        assert sorted(pids) == ["fastpar-rank0", "fastpar-rank1"]
        proc.kill()
        proc.wait(timeout=30)
        assert alive(pids.values()) == []


@linux_only
@pytest.mark.parametrize("mode", ["default", "catch"])
def test_sigterm_reaches_every_rank_then_the_caller(tmp_path, mode):
    with _sleeper(tmp_path, mode) as (proc, pids):
        deadline = time.monotonic() + 60  # both ranks wait in their loop, SIGTERM handled
        while not all((tmp_path / f"flag.ready{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        for rank in (0, 1):  # each rank got the signal and finished its work
            assert (tmp_path / f"flag.{rank}").read_text() == "stopped cleanly"
        if mode == "default":  # once the ranks are gone, SIGTERM ends the caller as usual
            assert proc.returncode == -signal.SIGTERM, err[-2000:]
        else:  # the caller's own handler ran, after the ranks returned their results
            assert proc.returncode == 0, err[-2000:]
            assert out.split("\n")[-3:] == ["caller saw SIGTERM", "[0, 1]", ""]
        assert alive(pids.values()) == []


def _meshes() -> tuple[int, int, int]:
    whole, tp_only = make_mesh(pp="world"), make_mesh(tp=2, dp=1)
    with pytest.raises(ValueError, match=r"make_mesh\(tp=2, cp=1, pp=1, dp=2\) needs 4 ranks"):
        make_mesh(tp=2, dp=2)
    return whole.pp_size, tp_only.tp_size, tp_only.dp_size


def test_make_mesh_spans_the_world_and_checks_the_data_parallel_size():
    """The tests' mesh helper (tests/_mesh.py): "world" is the world size; a ``dp`` that the
    world does not have is refused before any group is made."""
    assert run_ranks(_meshes, 2) == [(2, 2, 1), (2, 2, 1)]
