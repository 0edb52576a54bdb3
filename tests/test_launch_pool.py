"""``fastpar.launch.pool``: run_ranks on live ranks means what a fork means. Results in rank
order, the caller's RNG, environment, switches and output; nothing a call changes "in this rank
only" reaches the next call; groups cached by request, distinct within a call; an error or a
destroyed group retires the pool; what cannot travel forks; a test that leaks state in the
pytest process fails itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from fastpar import debug_checks
from fastpar.launch import pool
from fastpar.testing import RankError, run_ranks

pytestmark = pytest.mark.skipif(not pool.enabled(), reason="FASTPAR_TEST_POOL=0: no pool")


def _who(x):
    return dist.get_rank(), dist.get_world_size(), x, os.getpid()


def test_results_in_rank_order_from_the_same_live_ranks():
    first = run_ranks(_who, 4, "a")
    before = pool.stats()
    second = run_ranks(_who, 4, "b")
    assert [r[:3] for r in second] == [(r, 4, "b") for r in range(4)]
    assert [r[3] for r in first] == [r[3] for r in second]  # the same processes
    assert pool.stats()["pooled"] == before["pooled"] + 1
    assert pool.stats()["started"] == before["started"]


def _draw_and_read():
    return (
        torch.randn(3),
        os.environ.get("FASTPAR_POOL_PROBE"),
        debug_checks_on(),
        os.getcwd(),
    )


def debug_checks_on() -> bool:
    from fastpar import debug

    return debug.enabled()


def test_each_call_gets_the_callers_rng_environment_switches_and_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPAR_POOL_PROBE", "one")  # an environment change still pools
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(11)
    want = torch.randn(3)
    torch.manual_seed(11)
    before = pool.stats()["pooled"]
    with debug_checks(False):
        out = run_ranks(_draw_and_read, 2)
    assert pool.stats()["pooled"] == before + 1
    for draw, probe, checks, cwd in out:
        assert torch.equal(draw, want)  # as a forked rank would draw
        assert (probe, checks, cwd) == ("one", False, str(tmp_path))
    monkeypatch.setenv("FASTPAR_POOL_PROBE", "two")
    with debug_checks(True):
        assert {(p, c) for _, p, c, _ in run_ranks(_draw_and_read, 2)} == {("two", True)}


def _leave_things_changed():
    import fastpar.comm.collectives as coll
    from fastpar import debug

    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["FASTPAR_POOL_LEFTOVER"] = "1"
    debug.SWITCH.set(True)
    coll.copy_to_region = lambda x, group=None: x  # "this rank only", as a fork allowed
    os.chdir("/")
    return True


def _what_is_left():
    import fastpar.comm.collectives as coll
    from fastpar import debug

    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        os.environ.get("FASTPAR_POOL_LEFTOVER"),
        debug.SWITCH.overridden,
        coll.copy_to_region.__name__,
        os.getcwd(),
    )


def test_what_a_call_changes_in_its_ranks_does_not_reach_the_next_call():
    assert run_ranks(_leave_things_changed, 2) == [True, True]
    for left in run_ranks(_what_is_left, 2):
        assert left == (torch.float32, True, None, False, "copy_to_region", os.getcwd())


def _fail_on_one():
    if dist.get_rank() == 1:
        raise ValueError("planted")
    dist.barrier()


def test_an_error_is_the_ranks_and_the_next_call_gets_a_new_pool():
    run_ranks(_who, 2, 0)
    started = pool.stats()["started"]
    with pytest.raises(RankError, match="rank 1 of 2 raised ValueError: planted"):
        run_ranks(_fail_on_one, 2, timeout=30)
    assert [r[:3] for r in run_ranks(_who, 2, 1)] == [(0, 2, 1), (1, 2, 1)]
    assert pool.stats()["started"] == started + 1


def _groups():
    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])  # a second request within the call: a second group
    x = torch.ones(1)
    dist.all_reduce(x, group=a)
    dist.all_reduce(x, group=b)
    return a.group_name, b.group_name, float(x)


def test_groups_are_cached_across_calls_and_distinct_within_one():
    first = run_ranks(_groups, 2)
    second = run_ranks(_groups, 2)
    assert first == second  # the same groups, not new ones
    a, b, total = first[0]
    assert a != b and total == 4.0


def _destroy():
    g = dist.new_group([0, 1], group_desc="to-destroy")
    dist.destroy_process_group(g)
    return True


def test_destroying_a_group_retires_the_pool():
    run_ranks(_who, 2, 0)
    started = pool.stats()["started"]
    assert run_ranks(_destroy, 2) == [True, True]
    run_ranks(_who, 2, 0)
    assert pool.stats()["started"] == started + 1


def test_what_cannot_travel_forks(monkeypatch):
    before = pool.stats()
    local = lambda: dist.get_rank()  # noqa: E731  (a lambda does not pickle)
    assert run_ranks(local, 2) == [0, 1]
    assert pool.stats()["forked"] == before["forked"] + 1
    import fastpar.launch.pool as mod  # a monkeypatched caller: the ranks must see the patch

    monkeypatch.setattr(mod, "POOL_GROUP_TIMEOUT_S", 1.5)
    assert run_ranks(_patched_value, 2) == [1.5, 1.5]
    assert pool.stats()["forked"] == before["forked"] + 2


def _patched_value():
    return pool.POOL_GROUP_TIMEOUT_S


def _speak():
    print(f"pool rank {dist.get_rank()} speaks", flush=True)


def test_the_ranks_output_reaches_the_callers_capture(capfd):
    run_ranks(_speak, 2)
    out = capfd.readouterr().out
    assert "pool rank 0 speaks" in out and "pool rank 1 speaks" in out


def test_a_test_that_leaks_state_in_the_pytest_process_fails_itself(tmp_path):
    """tests/conftest.py's check, on a copy of it in a pytest of its own: the leaking test fails
    naming what it left, the next one passes."""
    here = os.path.dirname(__file__)
    for name in ("conftest.py", "_disk.py"):  # the conftest and the helper it imports
        with open(os.path.join(here, name)) as f:
            (tmp_path / name).write_text(f.read())
    (tmp_path / "slow_tier.txt").write_text("")
    (tmp_path / "test_leak.py").write_text(
        textwrap.dedent(
            """
            import torch

            def test_leaks():
                torch.set_default_dtype(torch.float64)

            def test_after():
                assert torch.get_default_dtype() == torch.float32
            """
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "ERROR at teardown of test_leaks" in out, out
    assert "default dtype: torch.float32 -> torch.float64" in out, out
    assert re.search(r"2 passed.*, 1 error", out), out
