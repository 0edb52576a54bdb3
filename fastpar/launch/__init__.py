"""The rank launcher: run a function on N ranks of this machine (gloo on CPUs by default).

    from fastpar.launch import run_ranks

    def check(scale):
        t = torch.ones(3) * (dist.get_rank() + 1) * scale
        dist.all_reduce(t)
        return t

    results = run_ranks(check, 4, 2.0)      # one result per rank, in rank order

Shared by the training command (``fastpar.train.launch``), the CLIs (``python -m fastpar.mesh
--check``) and the tests (``fastpar.testing`` re-exports it for users' parity tests).

* Ranks are forked from the calling process (about 0.1 s for 8 ranks, against 2 s a rank for
  ``spawn``, which re-imports torch), so a test suite can afford dozens of multi-rank tests.
  The function and its arguments need not be picklable; results must be.
* Rendezvous goes through a FileStore in a fresh temporary directory and gloo binds ports the
  OS picks, so runs can follow each other or run side by side without clashes.
* An exception on any rank is raised in the caller as ``RankError``, naming the rank and
  carrying its traceback; the other ranks are killed at once rather than left waiting.
* A run that outlives ``timeout`` seconds (default ``FASTPAR_TEST_TIMEOUT``, else 90) kills every
  rank and raises ``RankTimeout`` with the Python stack of each rank still running, so a hang
  fails in seconds and shows where it hangs. An error names the ranks that never answered
  (alive, but stopped or stuck).
* Ranks never outlive the caller: on Linux each rank is killed when the caller ends, even by
  SIGKILL (``PR_SET_PDEATHSIG``), and shows as ``fastpar-rank<N>`` in ps / top. A SIGTERM or
  SIGINT to the caller during the run goes to every rank (a rank may catch it to stop cleanly; a
  second one kills the ranks); once the ranks are gone it takes its usual effect in the caller.

Modules: ``ranks`` (``run_ranks``, the errors), ``worker`` (a rank's side), ``procs`` (process
states, ending ranks, forwarding signals).
"""

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
