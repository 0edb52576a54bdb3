"""A multi-process harness for parity tests: run a function on N gloo ranks on one CPU machine.

    from fastpar.testing import run_ranks

    def check(scale):
        t = torch.ones(3) * (dist.get_rank() + 1) * scale
        dist.all_reduce(t)
        return t

    results = run_ranks(check, 4, 2.0)      # one result per rank, in rank order
    report = check_parallel(lambda: MyModel(), tp=2, dp=2, zero=1)   # your model, proven

* Ranks are forked from the calling process (about 0.1 s for 8 ranks, against 2 s a rank for
  ``spawn``, which re-imports torch), so a test suite can afford dozens of multi-rank tests.
  The function and its arguments need not be picklable; results must be.
* Rendezvous goes through a FileStore in a fresh temporary directory and gloo binds ports the
  OS picks, so runs can follow each other or run side by side without clashes.
* An exception on any rank is raised in the caller as ``RankError``, naming the rank and
  carrying its traceback; the other ranks are killed at once rather than left waiting.
* A run that outlives ``timeout`` seconds kills every rank and raises ``RankTimeout`` with the
  Python stack of each rank still running, so a hang fails in seconds and shows where it hangs.
  An error names the ranks that never answered (alive, but stopped or stuck).
* Ranks never outlive the caller: on Linux each rank is killed when the caller ends, even by
  SIGKILL (``PR_SET_PDEATHSIG``), and shows as ``fastpar-rank<N>`` in ps / top. A SIGTERM or
  SIGINT to the caller during the run goes to every rank (a rank may catch it to stop cleanly; a
  second one kills the ranks); once the ranks are gone it takes its usual effect in the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = float(os.environ.get("FASTPAR_TEST_TIMEOUT", "90"))


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


_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def _bind_to_parent(parent_pid: int, name: str) -> None:
    """Linux: this process is killed when its parent ends, however it ends, and ``ps`` / ``top``
    show it as ``name``. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


def _default_signals() -> None:
    """A forked rank inherits the caller's Python signal handlers: give it the defaults back."""
    for sig, handler in (
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGINT, signal.default_int_handler),
    ):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)


class _Forwarder:
    """While ranks run, SIGTERM / SIGINT to the caller go to every live rank; a second one kills
    them. ``restore`` puts the caller's handlers back, then delivers the first signal received
    to the caller, so that it takes its usual effect once the ranks are gone. Installed only in
    the main thread, and not for a signal the caller ignores."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs, self.received, self.old = procs, [], {}
        self.owner = os.getpid()  # a forked rank runs this handler until it resets its own
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            old = signal.getsignal(sig)
            if old is not None and old is not signal.SIG_IGN:
                self.old[sig] = old
                signal.signal(sig, self._forward)

    def _forward(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.owner:
            return
        self.received.append(signum)
        self.send(signum if len(self.received) == 1 else signal.SIGKILL)

    def send(self, signum: int) -> None:
        for p in self.procs:
            if p.pid and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    def restore(self) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)
        if self.received:
            signal.raise_signal(self.received[0])


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    threads: int,
    conn: Any,
    stack_path: str,
    parent_pid: int,
    args: tuple,
    kwargs: dict,
) -> None:
    code = 0
    try:
        _bind_to_parent(parent_pid, f"fastpar-rank{rank}")
        _default_signals()
        with open(stack_path, "w") as stack_file:
            faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
            try:
                os.environ.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(world_size),
                )
                if sys.platform.startswith("linux"):
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                torch.set_num_threads(threads)
                store = dist.FileStore(store_path, world_size)
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(seconds=timeout),
                )
                if world_size > 1:  # every pair connected before anyone may finish and exit
                    dist.barrier()
                result = fn(*args, **kwargs)
                # plain pickle copies tensor data; multiprocessing's pickler would pass tensors
                # through shared memory that dies with this process at os._exit
                conn.send_bytes(pickle.dumps(("ok", rank, result)))
                if world_size > 1:  # nobody exits while a peer still finishes its last collective
                    with contextlib.suppress(Exception):
                        dist.barrier()
            except BaseException as exc:  # report everything, KeyboardInterrupt included
                tb = traceback.format_exc()
                try:
                    payload = pickle.dumps(exc)
                except Exception:
                    payload = None
                conn.send_bytes(
                    pickle.dumps(("error", rank, (type(exc).__name__, str(exc), tb, payload)))
                )
                code = 1
            # no destroy_process_group: tearing gloo down while a slower peer still finishes
            # its last collective can abort; os._exit closes every connection instead
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        os._exit(code)  # never run the parent's atexit handlers (pytest's, say) in a fork


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def process_status(pid: int) -> tuple[str, int] | None:
    """Linux: (state letter of /proc/<pid>/stat, e.g. "R", "S", "T" stopped, "Z" zombie; the
    parent's pid), or None when there is no such process (or no /proc)."""
    fields = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
    return (fields[0], int(fields[1])) if len(fields) > 1 else None


def _state(pid: int | None) -> str:
    status = process_status(pid) if pid else None
    if status is not None and status[0] in "Tt":
        return "its process is stopped: SIGSTOP or a debugger"
    return "its process is running or waiting"


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


_PREIMPORTED = False


def _preimport() -> None:
    """Import, once in the parent, what ranks would otherwise each import after the fork:
    building any torch optimizer imports torch._dynamo (seconds per rank on a small machine)."""
    global _PREIMPORTED
    if not _PREIMPORTED:
        _PREIMPORTED = True
        with contextlib.suppress(Exception):
            import torch._dynamo  # noqa: F401


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    backend: str = "gloo",
    start_method: str = "fork",
    threads_per_rank: int | None = None,
    collective_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    Each rank has an initialised default process group (``backend``, gloo by default) whose
    collectives time out with ``timeout``; RANK / WORLD_SIZE / LOCAL_RANK are set in its
    environment. ``start_method="spawn"`` is available when the caller already holds a process
    group or a CUDA context (forking those is unsafe); ``fn`` must then be importable.
    ``collective_timeout`` (default: ``timeout``) bounds each collective separately, so a long
    job can have a long ``timeout`` and still fail fast on a stuck collective.
    ``threads_per_rank`` is 1 for forked ranks (a forked OpenMP pool can hang: GNU libgomp is
    not fork-safe once the parent has used it) and cores / ranks for spawned ones.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
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
    ctx = mp.get_context(start_method)
    procs, conns = [], []
    tmp = tempfile.mkdtemp(prefix="fastpar-ranks-")
    store_path = os.path.join(tmp, "store")
    forwarder = _Forwarder(procs)
    try:
        if start_method == "fork":
            _preimport()
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
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
        return _collect(procs, conns, world_size, timeout, tmp)
    finally:
        _kill(procs)
        for c in conns:
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)
        forwarder.restore()


def _collect(procs: list[Any], conns: list[Any], world: int, timeout: float, tmp: str) -> list:
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
                status, _, payload = pickle.loads(c.recv_bytes())
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
        unanswered = "".join(f"\nno answer from rank {r} ({_state(procs[r].pid)})" for r in silent)
        text = (
            f"rank {rank} of {world} raised {name}: {msg}{unanswered}\n"
            f"--- traceback on rank {rank} ---\n{tb}"
        )
        if others:
            text += f"\n--- also failed (often as a consequence) ---{others}"
        raise RankError(text, rank, exc, tb) from exc
    if pending:  # timed out: ask each live rank for its stack, then kill everything
        live = sorted(pending.values())
        for r in live:
            if procs[r].is_alive() and procs[r].pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        stacks = "".join(
            f"\n--- stack of rank {r} ({_state(procs[r].pid)}) ---\n"
            f"{_read(os.path.join(tmp, f'stack{r}')) or '(none)'}"
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


def check_parallel(build_model: Callable[[], Any], plan=None, **kwargs: Any):
    """Prove a parallel layout of your own model equal to the single-process model (logits,
    loss, every gradient on every rank, the parameters after several AdamW steps); see
    ``fastpar.parity`` for the arguments. Returns a ``fastpar.parity.CheckReport``."""
    from fastpar.parity import check_parallel as _check

    return _check(build_model, plan, **kwargs)
