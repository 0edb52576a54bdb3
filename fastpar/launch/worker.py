"""The rank side of ``run_ranks``: bound to the caller's life, default signal handlers, a
stack dump on SIGUSR1, the process group, the function, its result or exception sent back."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fastpar import flight
from fastpar.flight.record import settle, torch_buffer

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def bind_to_parent(parent_pid: int, name: str) -> None:
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


def default_signals() -> None:
    """A forked rank inherits the caller's Python signal handlers: give it the defaults back."""
    for sig, handler in (
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGINT, signal.default_int_handler),
    ):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)


#: words of a communication failure's message (gloo's, NCCL's, torch.distributed's)
COMM_WORDS = ("gloo", "NCCL", "ProcessGroup", "c10d", "imed out", "timeout", "pair closure")


def comm_error(exc: BaseException | None, tb: str) -> bool:
    """Whether ``exc`` (None: judge by the traceback ``tb`` alone) came out of
    torch.distributed (a timeout, a closed connection, a mismatch gloo or NCCL found): then the
    flight recorder's analysis says which collective. A work's ``wait()`` raises from C++ with
    no torch.distributed frame: its message says what it is."""
    dist_error = getattr(dist, "DistError", ())
    if (exc is not None and isinstance(exc, dist_error)) or "torch/distributed/" in tb:
        return True
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    return last.startswith(("RuntimeError", "torch.distributed")) and any(
        word in last for word in COMM_WORDS
    )


def error_report(exc: BaseException, flight_dir: str) -> tuple:
    """What a rank sends back for ``exc`` (inside its ``except``): (type name, message,
    traceback, the pickled exception or None). A communication failure dumps this rank's flight
    records first, for the launcher's analysis."""
    tb = traceback.format_exc()
    if comm_error(exc, tb):
        with contextlib.suppress(Exception):
            flight.dump(flight_dir, f"{type(exc).__name__}: {exc}"[:2000])
    try:
        payload = pickle.dumps(exc)
    except Exception:
        payload = None
    return type(exc).__name__, str(exc), tb, payload


def worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    threads: int,
    conn: Any,
    stack_path: str,
    flight_dir: str,
    parent_pid: int,
    args: tuple,
    kwargs: dict,
) -> None:
    code = 0
    try:
        bind_to_parent(parent_pid, f"fastpar-rank{rank}")
        default_signals()
        with open(stack_path, "w") as stack_file:
            flight.arm(flight_dir, rank)  # SIGUSR1: this rank's flight records, and its stack
            faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=True)
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
                torch_buffer()  # FASTPAR_FLIGHT=0: torch's recorder off too
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
                    try:
                        dist.barrier()
                    except Exception as exc:  # a peer failed: this rank's records too
                        with contextlib.suppress(Exception):
                            flight.dump(flight_dir, f"after its result: {type(exc).__name__}")
            except BaseException as exc:  # report everything, KeyboardInterrupt included
                conn.send_bytes(pickle.dumps(("error", rank, error_report(exc, flight_dir))))
                code = 1
            # no destroy_process_group: tearing gloo down while a slower peer still finishes
            # its last collective can abort; os._exit closes every connection instead
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        settle()  # a dump SIGUSR1 asked for is written in full
        os._exit(code)  # never run the parent's atexit handlers (pytest's, say) in a fork
