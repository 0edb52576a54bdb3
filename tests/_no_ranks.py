"""``forbid_ranks``: make any start of training ranks a test failure (for checks that must come
before any rank starts)."""

from __future__ import annotations


def _started(*args, **kwargs):
    raise AssertionError("a rank was started: the check did not come before the ranks")


def forbid_ranks(monkeypatch) -> None:
    """Fail the test if the command launches its run or starts a rank."""
    import importlib

    import fastpar.launch
    import fastpar.testing
    import fastpar.train.cli

    # the module (fastpar.train re-exports the function launch under the same name)
    train_launch = importlib.import_module("fastpar.train.launch")
    monkeypatch.setattr(fastpar.testing, "run_ranks", _started)
    monkeypatch.setattr(fastpar.launch, "run_ranks", _started)
    monkeypatch.setattr(train_launch, "run_ranks", _started)
    monkeypatch.setattr(fastpar.train.cli, "launch", _started)
