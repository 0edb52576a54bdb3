"""The rank launcher: run a function on N ranks of this machine (gloo on CPUs by default).

    results = run_ranks(check, 4, 2.0)      # check(2.0) on 4 ranks, one result per rank

Forked ranks, errors and hangs named, ranks that never outlive the caller: docs/development.md
("The rank launcher")."""

from __future__ import annotations

from fastpar.launch.procs import process_status
from fastpar.launch.ranks import (
    DEFAULT_TIMEOUT_S,
    RankError,
    RankTimeout,
    default_timeout,
    run_ranks,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankError",
    "RankTimeout",
    "default_timeout",
    "process_status",
    "run_ranks",
]
