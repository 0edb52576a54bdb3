"""Every ``FASTPAR_*`` switch: listed in docs/switches.md's table; the library's have an API that wins
over the variable, read once per process (never per call on a hot path), again after
``refresh()`` and in a forked child; bad values named in one line."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import fastpar
from fastpar import debug, moe, switches
from fastpar.launch import default_timeout
from fastpar.moe import overlap
from fastpar.ops import backend
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, build_parser

ROOT = Path(__file__).resolve().parents[1]
#: a preprocessor macro of the C++ sources (setup.py defines it), not an environment variable
NOT_ENV = {"FASTPAR_WITH_CUDA"}


@pytest.fixture(autouse=True)
def _switches_as_the_environment_says(monkeypatch):
    """After each test: the variables back as they were, and read again (a switch keeps what
    it read, and later tests in this process must see the real environment)."""
    yield
    monkeypatch.undo()
    switches.refresh_all()


def _switch_names() -> set[str]:
    files = [ROOT / "setup.py", ROOT / ".ci" / "run", *(ROOT / "scripts").glob("*.sh")]
    for folder in ("fastpar", "bench"):
        files += (ROOT / folder).rglob("*.py")
    found = set()
    for f in files:
        if f.is_file():
            found |= set(re.findall(r"FASTPAR_[A-Z0-9_]+", f.read_text()))
    return found - NOT_ENV


def test_the_docs_list_every_switch_in_one_table():
    text = (ROOT / "docs" / "switches.md").read_text()
    head = text.index("| switch | what it does | API equivalent | default |")
    table = text[head:].split("\n\n", 1)[0]
    rows = {m for m in re.findall(r"^\| `(FASTPAR_[A-Z0-9_]+)`", table, flags=re.M)}
    names = _switch_names()
    assert len(names) >= 11, names
    assert names <= rows, f"not in docs/switches.md's table: {sorted(names - rows)}"


class _CountingEnviron(dict):
    reads = 0

    def get(self, key, default=None):
        if key.startswith("FASTPAR_"):
            type(self).reads += 1
        return super().get(key, default)


@pytest.mark.parametrize(
    "switch,use",
    [
        (debug.SWITCH, debug.enabled),
        (backend.SWITCH, lambda: backend.select("cross_entropy", "cpu")),
        (overlap._TRANSPORT, lambda: overlap.CapacityChunks(4, 8, 2, 2, 2)),
    ],
    ids=["debug", "backend", "moe-transport"],
)
def test_a_switch_is_read_once_not_per_call(switch, use, monkeypatch):
    environ = _CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    _CountingEnviron.reads = 0
    switch.refresh()
    for _ in range(1000):
        use()
    assert _CountingEnviron.reads == 1


def test_debug_checks_variable_api_and_refresh(monkeypatch):
    """(moved from tests/test_debug_checks.py, with the refresh a read-once switch needs)"""
    fastpar.debug_checks(None)
    monkeypatch.delenv(debug.ENV_VAR, raising=False)
    debug.refresh()
    assert not debug.enabled()
    for raw, want in (("1", True), ("true", True), (" ON ", True), ("0", False), ("", False)):
        monkeypatch.setenv(debug.ENV_VAR, "0" if want else "1")
        debug.refresh()
        assert debug.enabled() is not want  # read, and kept
        monkeypatch.setenv(debug.ENV_VAR, raw)
        assert debug.enabled() is not want, raw  # read once: the change is not seen ...
        debug.refresh()
        assert debug.enabled() is want, raw  # ... until refresh()
    monkeypatch.setenv(debug.ENV_VAR, "maybe")
    debug.refresh()
    with pytest.raises(ValueError, match=r"FASTPAR_DEBUG_CHECKS='maybe' is not 1 or 0; set"):
        debug.enabled()
    monkeypatch.setenv(debug.ENV_VAR, "0")
    debug.refresh()
    with fastpar.debug_checks():  # a block overrides the variable, then restores
        assert debug.enabled()
        with fastpar.debug_checks(False):
            assert not debug.enabled()
        assert debug.enabled()
    assert not debug.enabled()
    fastpar.debug_checks(True)  # a plain call: from now on
    monkeypatch.setenv(debug.ENV_VAR, "maybe")  # not consulted while the API holds the switch
    assert debug.enabled()
    monkeypatch.setenv(debug.ENV_VAR, "0")
    fastpar.debug_checks(None)  # back to the variable, read again
    assert not debug.enabled()
    with pytest.raises(TypeError, match="debug_checks takes True, False or None, got 'yes'"):
        fastpar.debug_checks("yes")


def test_backend_variable_api_and_refresh(monkeypatch):
    """(tests/test_package.py's selection rules, with the refresh a read-once switch needs)"""
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    backend.refresh()
    name = "test_switches_op"
    backend.register_op(name, ("triton", "reference"))
    try:
        assert backend.select(name, "cpu") == "reference"
        auto = "triton" if backend.triton_status()[0] else "reference"
        assert backend.select(name, "cuda") == auto
        with backend.use_backend("reference"):
            assert backend.select(name, "cuda") == "reference"
        monkeypatch.setenv(backend.ENV_VAR, "reference")
        backend.refresh()
        assert backend.select(name, "cuda") == "reference"
        monkeypatch.delenv(backend.ENV_VAR)
        assert backend.select(name, "cuda") == "reference"  # read once
        backend.refresh()
        assert backend.select(name, "cuda") == auto
        monkeypatch.setenv(backend.ENV_VAR, "reference")
        backend.refresh()
        with backend.use_backend("auto"):  # the API wins: "auto" is the rule, not the variable
            assert backend.select(name, "cuda") == auto
        backend.use_backend("triton")  # a plain call: for the process
        assert backend.select(name, "cpu") == "triton" or not backend.triton_status()[0]
        backend.use_backend(None)  # back to the variable, read again
        assert backend.select(name, "cuda") == "reference"
        monkeypatch.setenv(backend.ENV_VAR, "bogus")
        backend.refresh()
        with pytest.raises(ValueError, match="FASTPAR_BACKEND='bogus' is not one of auto/triton"):
            backend.select(name, "cpu")
        monkeypatch.delenv(backend.ENV_VAR)
        backend.refresh()
        with (
            pytest.raises(ValueError, match="has no 'extension' backend"),
            backend.use_backend("extension"),
        ):
            backend.select(name, "cpu")
        with pytest.raises(ValueError, match="backend 'cpu' is not one of auto/triton"):
            backend.use_backend("cpu")
        with pytest.raises(ValueError, match="must be drawn from"):
            backend.register_op("bad", ("triton",))
    finally:
        backend._OPS.pop(name, None)
        backend.use_backend(None)


def test_moe_transport_api_and_variable(monkeypatch):
    monkeypatch.setenv(overlap.TRANSPORT_ENV, "python")
    overlap._TRANSPORT.refresh()
    assert moe.transport() == "python"
    built = overlap._extension_ops()
    with moe.set_transport("extension" if built else "python"):
        assert moe.transport() == ("extension" if built else "python")
        chunks = overlap.CapacityChunks(4, 8, 2, 2, 2)  # a layer call chooses once, here
        assert chunks.transport == moe.transport()
    assert moe.transport() == "python"
    if not built:
        with (
            pytest.raises(RuntimeError, match="set_transport asks for the extension transport"),
            moe.set_transport("extension"),
        ):
            moe.transport()
    with pytest.raises(ValueError, match="transport 'nccl' is not 'python' or 'extension'"):
        moe.set_transport("nccl")
    monkeypatch.setenv(overlap.TRANSPORT_ENV, "mpi")
    overlap._TRANSPORT.refresh()
    with pytest.raises(ValueError, match="FASTPAR_MOE_TRANSPORT='mpi' is not one of python/ext"):
        moe.transport()
    monkeypatch.delenv(overlap.TRANSPORT_ENV)
    overlap._TRANSPORT.refresh()
    assert moe.transport() == ("extension" if built else "python")


def _in_a_forked_rank() -> tuple[str, bool]:
    os.environ[overlap.TRANSPORT_ENV] = "python"  # set before the first use in this process
    os.environ[debug.ENV_VAR] = "1"
    return moe.transport(), debug.enabled()


def test_a_forked_rank_reads_the_variables_again(monkeypatch):
    monkeypatch.delenv(overlap.TRANSPORT_ENV, raising=False)
    monkeypatch.delenv(debug.ENV_VAR, raising=False)
    switches.refresh_all()
    expected_here = moe.transport(), debug.enabled()  # read (and kept) in this process
    assert expected_here[1] is False
    assert run_ranks(_in_a_forked_rank, 1) == [("python", True)]
    assert (moe.transport(), debug.enabled()) == expected_here


def test_timeouts_are_read_when_used_not_at_import(monkeypatch):
    monkeypatch.setenv("FASTPAR_COLLECTIVE_TIMEOUT", "12")
    assert TrainConfig.from_flags().collective_timeout == 12.0
    assert build_parser().parse_args([]).collective_timeout == 12.0
    monkeypatch.delenv("FASTPAR_COLLECTIVE_TIMEOUT")
    assert TrainConfig.from_flags().collective_timeout == 300.0
    monkeypatch.setenv("FASTPAR_TEST_TIMEOUT", "7.5")
    assert default_timeout() == 7.5
    monkeypatch.setenv("FASTPAR_TEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"FASTPAR_TEST_TIMEOUT='soon' is not a number of second"):
        default_timeout()
    monkeypatch.delenv("FASTPAR_TEST_TIMEOUT")
    assert default_timeout() == 90.0
