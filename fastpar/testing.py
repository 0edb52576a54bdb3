"""Test helpers for users' own parity tests: prove a parallel layout of a model, run a check on
N ranks.

    from fastpar.testing import check_parallel, run_ranks

    report = check_parallel(lambda: MyModel(), tp=2, dp=2, zero=1)   # your model, proven
    results = run_ranks(check, 4, 2.0)      # check(2.0) on 4 gloo ranks, results in rank order
    assert_agree(parallel, [single, twin], exact, length=n)   # the rule: fastpar.tolerance

``run_ranks``, ``RankError``, ``RankTimeout`` and ``process_status`` are the rank launcher's
(``fastpar.launch``, which the training command and the CLIs use too), re-exported here.

When two runs agree (``fastpar.tolerance``, re-exported: ``compare``, ``assert_agree``,
``nudge``, ``Comparison``): compare a parallel run and the single-process run in the working
precision with the same math in float64; the parallel run's error may be at most ``FACTOR`` (4)
times the single-process run's own error (take the larger of it and its ``nudge``d twin's) plus
a floor of ``FLOOR`` (4) · (u + u_fp32 · sqrt(n)) · max |exact| — u the working precision's unit
roundoff, n the longest reduction feeding the quantity — plus, after AdamW steps, what AdamW can
make of the gradients' bounds (``adam_slack``). Claim bit-for-bit equality only where both sides
run the same kernels in the same order. ``docs/tolerances.md`` derives the rule.
"""

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
