"""Test tiers (see scripts/run_tests.sh):

* ``interpreter``: Triton kernels on CPU tensors under TRITON_INTERPRET=1. The variable must be
  set before Triton defines a kernel, so these run in their own pytest process; in any other
  process they are skipped with that reason.
* ``cuda``: needs an NVIDIA GPU; skipped with that reason elsewhere.

Custom ops' aliasing is checked as an error in every run (as CI's environment makes it).

``FASTPAR_TEST_SEED=k`` (default 0) shifts every seed the tests and fastpar set
(``torch.manual_seed`` and ``torch.Generator().manual_seed``) by ``k`` · 1000003: the same tests
under other draws, to show a verdict does not depend on the seed (docs/tolerances.md). Ranks
started by fork inherit the shift; a test whose ranks are spawned sees the plain seeds.
"""

from __future__ import annotations

import os

# torch.compile's check that no custom op's output aliases its inputs is an error only where
# the CI variable is set (a warning elsewhere): make it an error in every run, so a local run
# fails where CI would. Read when torch._functorch.config is first imported, so set it first.
os.environ.setdefault("TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING", "1")

import faulthandler

import pytest
import torch
from _disk import small_disk  # noqa: F401 (the fixture: a real small filesystem)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SEED_SHIFT = int(os.environ.get("FASTPAR_TEST_SEED", "0") or 0) * 1_000_003


def _shift_seeds(shift: int) -> None:
    """Every later ``torch.manual_seed(s)`` and ``torch.Generator().manual_seed(s)`` seeds
    ``s + shift`` instead."""
    plain = torch.random.manual_seed

    def manual_seed(seed):
        return plain(int(seed) + shift)

    class Generator(torch.Generator):
        def manual_seed(self, seed):
            return super().manual_seed(int(seed) + shift)

    torch.manual_seed = torch.random.manual_seed = manual_seed
    torch.Generator = Generator


if SEED_SHIFT:
    _shift_seeds(SEED_SHIFT)


POOL = os.environ.get("FASTPAR_TEST_POOL", "1").strip() != "0"
_current: dict = {}


def _why_fork() -> str | None:
    """The running test has monkeypatched an attribute (the ranks of a fork would see it, the
    pool's live ranks would not): its run_ranks calls fork."""
    item = _current.get("item")
    if item is not None and item.get_closest_marker("own_ranks") is not None:
        return "the test is marked own_ranks"
    mp = getattr(item, "funcargs", {}).get("monkeypatch") if item is not None else None
    if mp is not None and (mp._setattr or any(d is not os.environ for d, _, _ in mp._setitem)):
        return "the test monkeypatched an attribute"
    return None


def pytest_configure(config):
    from fastpar.launch import pool

    pool.use_pool(POOL)
    pool.set_guard(_why_fork)


def pytest_unconfigure(config):
    from fastpar.launch import pool

    pool.use_pool(False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["item"] = item
    try:
        return (yield)
    finally:
        _current.pop("item", None)


def _parent_state() -> dict:
    """What a test may change in the pytest process and must put back (else later tests, and
    the ranks they fork, inherit it)."""
    import torch.distributed as dist

    from fastpar import families
    from fastpar.switches import _SWITCHES

    return {
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "a default process group": dist.is_available() and dist.is_initialized(),
        "HF family registry": sorted(families.REGISTRY),
        "switch overrides": sorted(
            (s.env, repr(s._override)) for s in list(_SWITCHES) if s._override is not None
        ),
        "environment": sorted(
            (k, v)
            for k, v in os.environ.items()
            if k.startswith(("FASTPAR_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))
        ),
    }


@pytest.fixture
def _no_state_leaks():
    """A test that leaves global state behind in this process fails itself (not the next test
    that happens to read it): each item of ``_parent_state`` is compared after the test."""
    before = _parent_state()
    yield
    after = _parent_state()
    leaked = [k for k in before if before[k] != after[k]]
    if leaked:
        import torch.distributed as dist

        from fastpar import families  # noqa: F401

        torch.set_default_dtype(before["default dtype"])
        torch.set_grad_enabled(before["grad mode"])
        if dist.is_available() and dist.is_initialized() and not before[leaked[0]]:
            dist.destroy_process_group()
        pytest.fail(
            "the test left global state changed in the pytest process: "
            + "; ".join(f"{k}: {before[k]!r} -> {after[k]!r}" for k in leaked)
            + " -- restore it (a fixture, try/finally, or monkeypatch)",
            pytrace=False,
        )


def _fatal_errors_to_this_stderr() -> None:
    """In a process forked from pytest's (a rank): Python's report of a fatal signal goes to
    this process's own stderr, which pytest captures for the test that started it (printed
    with that test's failure, as its other output is), not to the terminal's stderr that
    pytest's faulthandler plugin duplicated at start-up: a rank a test crashes on purpose (gloo
    aborts it) must not print into a passing run's log."""
    if faulthandler.is_enabled():
        faulthandler.enable(file=2, all_threads=True)


os.register_at_fork(after_in_child=_fatal_errors_to_this_stderr)


@pytest.fixture(autouse=True)
def _switches_follow_the_environment(_no_state_leaks, monkeypatch):
    """fastpar reads each FASTPAR_* switch once per process: after a test that changed one,
    undo the change and read the variables again, so no cached value leaks into later tests."""
    yield
    from fastpar import switches

    monkeypatch.undo()
    switches.refresh_all()


SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tier.txt")


def _slow_list() -> list[str]:
    """tests/slow_tier.txt's node ids (a whole line each; '#' starts a comment line)."""
    with open(SLOW_LIST) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def _whole_files(config) -> set[str]:
    """The test files (relative to the root) this run collects whole: named as a file or under a
    named folder, not narrowed by ``::`` or ``-k``."""
    if config.getoption("keyword", ""):
        return set()
    root = str(config.rootpath)
    out = set()
    for arg in config.args or [os.getcwd()]:
        if "::" in arg:
            continue
        path = os.path.abspath(arg)
        if os.path.isdir(path):
            for dirpath, _, names in os.walk(path):
                out.update(
                    os.path.relpath(os.path.join(dirpath, n), root)
                    for n in names
                    if n.startswith("test_") and n.endswith(".py")
                )
        else:
            out.add(os.path.relpath(path, root))
    return out


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    listed = set(_slow_list())
    slow = pytest.mark.slow
    found = set()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(slow)
            found.add(item.nodeid)
    whole = _whole_files(config)
    stale = sorted(n for n in listed - found if n.split("::")[0] in whole)
    if stale:
        raise pytest.UsageError(
            f"tests/slow_tier.txt names {len(stale)} test(s) that were not collected (renamed or "
            "removed?): " + "; ".join(stale[:5]) + " -- fix or remove those lines"
        )
    _skip_by_tier(items)


def _skip_by_tier(items) -> None:
    no_interp = pytest.mark.skip(
        reason="interpreter tier: run with TRITON_INTERPRET=1 in its own process "
        "(scripts/run_tests.sh does)"
    )
    no_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU (GPU tier: pytest -m cuda)")
    for item in items:
        if "interpreter" in item.keywords and not INTERPRETING:
            item.add_marker(no_interp)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
