"""Test helpers for users' own parity tests: prove a parallel layout of a model, run a check on
N ranks.

    from fastpar.testing import check_parallel, run_ranks

    report = check_parallel(lambda: MyModel(), tp=2, dp=2, zero=1)   # your model, proven
    results = run_ranks(check, 4, 2.0)      # check(2.0) on 4 gloo ranks, results in rank order

``run_ranks``, ``RankError``, ``RankTimeout`` and ``process_status`` are the rank launcher's
(``fastpar.launch``, which the training command and the CLIs use too), re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastpar.launch import RankError, RankTimeout, process_status, run_ranks

__all__ = ["RankError", "RankTimeout", "check_parallel", "process_status", "run_ranks"]


def check_parallel(build_model: Callable[[], Any], plan=None, **kwargs: Any):
    """Prove a parallel layout of your own model equal to the single-process model (logits,
    loss, every gradient on every rank, the parameters after several AdamW steps); see
    ``fastpar.parity`` for the arguments. Returns a ``fastpar.parity.CheckReport``."""
    from fastpar.parity import check_parallel as _check

    return _check(build_model, plan, **kwargs)
