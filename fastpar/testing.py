"""Test helpers for users' own parity tests: prove a parallel layout of a model, run a check on
N ranks.

    report = check_parallel(lambda: MyModel(), tp=2, dp=2, zero=1)   # your model, proven
    results = run_ranks(check, 4, 2.0)      # check(2.0) on 4 gloo ranks, results in rank order
    assert_agree(parallel, [single, twin], exact, length=n)   # the rule: fastpar.tolerance

The launcher's and the tolerance's names are re-exported here (docs/tolerances.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastpar.launch import RankError, RankTimeout, process_status, run_ranks
from fastpar.tolerance import Comparison, assert_agree, compare, nudge

__all__ = [
    "Comparison",
    "RankError",
    "RankTimeout",
    "assert_agree",
    "check_parallel",
    "compare",
    "nudge",
    "process_status",
    "run_ranks",
]


def check_parallel(build_model: Callable[[], Any], plan=None, **kwargs: Any):
    """Prove a parallel layout of your own model equal to the single-process model (logits,
    loss, every gradient on every rank, the parameters after several AdamW steps); see
    ``fastpar.parity`` for the arguments. Returns a ``fastpar.parity.CheckReport``."""
    from fastpar.parity import check_parallel as _check

    return _check(build_model, plan, **kwargs)
