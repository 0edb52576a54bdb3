"""``run_ranks``: start N ranks on this machine, collect their results, or raise the first
rank's error (``RankError``) or, past the timeout, every live rank's stack (``RankTimeout``)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from fastpar.flight.analyse import analyse
from fastpar.flight.files import collect
from fastpar.flight.record import enabled
from fastpar.launch import pool
from fastpar.launch.procs import Forwarder, kill, process_status, read_file, state
from fastpar.launch.worker import comm_error, worker

#: seconds ``run_ranks`` waits without ``timeout=`` (and without FASTPAR_TEST_TIMEOUT)
DEFAULT_TIMEOUT_S = 90.0
TIMEOUT_ENV = "FASTPAR_TEST_TIMEOUT"


def default_timeout() -> float:
    """``run_ranks``'s timeout when none is given: FASTPAR_TEST_TIMEOUT seconds (read at each
    ``run_ranks`` call, not at import), else ``DEFAULT_TIMEOUT_S``."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r} is not a number of seconds: set it to one (e.g. 300), or "
            "pass run_ranks(timeout=...)"
        ) from None


class RankError(RuntimeError):
    """An exception raised on one rank of ``run_ranks``.

    Attributes: ``rank``; ``exception`` (the original exception, or None if it could not be
    pickled); ``remote_traceback`` (the formatted traceback on that rank).
    """

    def __init__(self, message: str, rank: int, exception: BaseException | None, tb: str):
        super().__init__(message)
        self.rank = rank
        self.exception = exception
        self.remote_traceback = tb


class RankTimeout(RankError, TimeoutError):
    """``run_ranks`` ran past its timeout; the message holds each live rank's stack."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    backend: str = "gloo",
    start_method: str = "fork",
    threads_per_rank: int | None = None,
    collective_timeout: float | None = None,
    flight_dir: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.
    Each rank has an initialised default process group (``backend``, gloo by default) and
    RANK / WORLD_SIZE / LOCAL_RANK in its environment. The arguments (``timeout``,
    ``collective_timeout``, ``start_method``, ``threads_per_rank``, ``flight_dir``):
    docs/development.md ("The rank launcher")."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    timeout = default_timeout() if timeout is None else float(timeout)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive (seconds), got {timeout}")
    if start_method == "fork":
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "run_ranks(start_method='fork') cannot fork a process that holds a process "
                "group; destroy it first or pass start_method='spawn'"
            )
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError(
                "run_ranks(start_method='fork') cannot fork a process with a CUDA context; "
                "pass start_method='spawn'"
            )
    if threads_per_rank is None:
        threads_per_rank = (
            1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world_size)
        )
    elif threads_per_rank > 1 and start_method == "fork":
        raise ValueError(
            f"threads_per_rank={threads_per_rank} with start_method='fork': a forked rank that "
            "starts an OpenMP thread pool hangs if the parent already used one (GNU libgomp is "
            "not fork-safe); use threads_per_rank=1 or start_method='spawn'"
        )
    if pool.why_fork(backend, start_method, threads_per_rank) is None:
        blob = pool.pack(fn, args, kwargs)
        if blob is not None:
            waits = timeout if collective_timeout is None else float(collective_timeout)
            return _run_pooled(blob, world_size, timeout, waits, flight_dir)
    pool._stats["forked"] += 1
    ctx = mp.get_context(start_method)
    procs, conns = [], []
    tmp = tempfile.mkdtemp(prefix="fastpar-ranks-")
    store_path = os.path.join(tmp, "store")
    forwarder = Forwarder(procs)
    asked = _on_usr1(procs, world_size, flight_dir or os.path.join(tmp, "flight"))
    try:
        if start_method == "fork":
            pool.preimport()
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    backend,
                    store_path,
                    timeout if collective_timeout is None else float(collective_timeout),
                    threads_per_rank,
                    child_end,
                    os.path.join(tmp, f"stack{rank}"),
                    flight_dir or os.path.join(tmp, "flight"),
                    os.getpid(),
                    args,
                    kwargs,
                ),
                name=f"fastpar-rank{rank}",
                daemon=True,
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        if forwarder.received:  # it came while ranks were starting: every rank gets it now
            forwarder.send(forwarder.received[0])
        return _collect(procs, conns, world_size, timeout, tmp, flight_dir)
    finally:
        kill(procs)
        for c in conns:
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)
        forwarder.restore()
        if asked is not None:
            signal.signal(signal.SIGUSR1, asked)


def _run_pooled(
    blob: bytes, world: int, timeout: float, collective_timeout: float, flight_dir: str | None
) -> list[Any]:
    """``run_ranks`` on the live ranks of ``fastpar.launch.pool``; any error or timeout ends
    the pool (a rank may be stuck in a collective)."""
    live = pool.pool_for(world)
    tmp = tempfile.mkdtemp(prefix="fastpar-call-")
    where = flight_dir or os.path.join(tmp, "flight")
    forwarder = Forwarder(live.procs)
    asked = _on_usr1(live.procs, world, where)
    done = False
    try:
        live.send(blob, where, collective_timeout)
        pool._stats["pooled"] += 1
        retiring: set[int] = set()
        results = _collect(live.procs, live.results, world, timeout, live.tmp, where, retiring)
        done = not retiring
        return results
    finally:
        if not done:
            live.close()
        shutil.rmtree(tmp, ignore_errors=True)
        forwarder.restore()
        if asked is not None:
            signal.signal(signal.SIGUSR1, asked)


def _on_usr1(procs: list[Any], world: int, directory: str):
    """While ranks run, SIGUSR1 to the caller asks every rank for its flight records and prints
    the analysis to stderr; the run goes on (``fastpar.flight``; without it SIGUSR1's default
    action would end the caller and its ranks). Returns the handler it replaced, or None when
    none was installed (not the main thread, SIGUSR1 ignored or taken, or FASTPAR_FLIGHT=0)."""
    owner = os.getpid()
    if threading.current_thread() is not threading.main_thread() or not enabled():
        return None
    old = signal.getsignal(signal.SIGUSR1)
    if old not in (signal.SIG_DFL, None):
        return None

    def report(signum, frame) -> None:
        if os.getpid() != owner:  # a forked rank before it arms its own
            return
        text = flight_report(procs, [], [], world, directory, time.time())
        print(text or "\nfastpar: SIGUSR1: no rank wrote a flight dump", file=sys.stderr)

    signal.signal(signal.SIGUSR1, report)
    return old


def _collect(
    procs: list[Any],
    conns: list[Any],
    world: int,
    timeout: float,
    tmp: str,
    flight_dir,
    retiring: set[int] | None = None,
) -> list:
    began = time.time()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: list[tuple[int, tuple]] = []
    pending = {c: r for r, c in enumerate(conns)}
    grace_end = None
    while pending:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        limit = deadline if grace_end is None else min(deadline, grace_end)
        if now >= limit:
            break
        ready = wait(list(pending), timeout=limit - now)
        for c in ready:
            rank = pending.pop(c)
            try:
                status, _, payload, *more = pickle.loads(c.recv_bytes())
                if more and more[0] and retiring is not None:  # a pool's rank that will exit
                    retiring.add(rank)
            except (EOFError, OSError):
                procs[rank].join(timeout=1)
                status = "error"
                code = procs[rank].exitcode
                what = f"signal {-code}" if code is not None and code < 0 else f"code {code}"
                payload = ("ProcessDied", f"rank {rank} exited ({what}) without a result", "", None)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append((rank, payload))
                if grace_end is None:  # give the others a moment to report their own errors
                    grace_end = time.monotonic() + 1.0
    if errors:
        rank, (name, msg, tb, blob) = errors[0]
        exc = None
        if blob is not None:
            with contextlib.suppress(Exception):
                exc = pickle.loads(blob)
        others = "".join(f"\n  rank {r}: {p[0]}: {p[1]}" for r, p in errors[1:])
        silent = [r for r in sorted(pending.values()) if procs[r].is_alive()]
        unanswered = "".join(f"\nno answer from rank {r} ({state(procs[r].pid)})" for r in silent)
        text = (
            f"rank {rank} of {world} raised {name}: {msg}{unanswered}\n"
            f"--- traceback on rank {rank} ---\n{tb}"
        )
        if others:
            text += f"\n--- also failed (often as a consequence) ---{others}"
        dumped = [r for r, p in errors if comm_error(None, p[2])]
        if dumped or any(p[0] == "ProcessDied" for _, p in errors):  # else its own error says
            where = flight_dir or os.path.join(tmp, "flight")
            text += flight_report(procs, silent, dumped, world, where, began)
        raise RankError(text, rank, exc, tb) from exc
    if pending:  # timed out: ask each live rank for its stack, then kill everything
        live = sorted(pending.values())
        for r in live:
            if procs[r].is_alive() and procs[r].pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGUSR1)
        where = flight_dir or os.path.join(tmp, "flight")
        report = flight_report(procs, live, [], world, where, began)
        time.sleep(0.3)
        stacks = report + "".join(
            f"\n--- stack of rank {r} ({state(procs[r].pid)}) ---\n"
            f"{read_file(os.path.join(tmp, f'stack{r}')) or '(none)'}"
            for r in live
        )
        raise RankTimeout(
            f"ranks {live} of {world} did not finish within {timeout:g} s (the others did); "
            f"raise timeout= or FASTPAR_TEST_TIMEOUT if the work is just slow{stacks}",
            live[0],
            None,
            stacks,
        )
    return [results[r] for r in range(world)]


def flight_report(
    procs: list[Any], live: list[int], dumped: list[int], world: int, directory: str, since: float
) -> str:
    """Ask every rank still running for its flight records (SIGUSR1; a stopped one cannot
    answer; ``live``: those that gave no result), wait briefly for their dumps and those of
    ``dumped`` (ranks that dumped as they failed), and return the analysis as a section of the
    error ("" without dumps; nothing with ``FASTPAR_FLIGHT=0``)."""
    if not enabled():
        return ""
    known = {}
    for r in range(world):  # those done too: they wait in the launcher's last barrier
        pid = procs[r].pid
        status = process_status(pid) if pid else None
        if status is not None and status[0] in "Tt":
            known[r] = "stopped: SIGSTOP or a debugger"
        elif procs[r].is_alive() and pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
    # every rank still running dumps on SIGUSR1; those whose collective failed did as it failed
    answering = [r for r in range(world) if r not in known and procs[r].is_alive()]
    dumps = collect(directory, sorted(set(answering + dumped)), timeout=3.0, since=since)
    if not dumps:
        return ""
    for r in range(world):
        code = procs[r].exitcode
        if code is not None and code < 0 and r not in known:
            known[r] = f"died of {signal.Signals(-code).name}" + (
                ": gloo aborts a rank that receives more bytes than it expects"
                if -code == signal.SIGABRT
                else ""
            )
        elif r in live and r not in known and not procs[r].is_alive():
            known[r] = f"exited ({code}) without a result"
    result = analyse(dumps, world, known)
    full = sum(not d.get("partial") for d in dumps)
    return f"\n--- flight recorder: {full} dumps in {directory} ---\n{result.text()}"
