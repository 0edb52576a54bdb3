"""The caller's side of ``run_ranks``: what state a rank's process is in (Linux ``/proc``),
ending ranks, and forwarding SIGTERM / SIGINT / SIGHUP to them."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any


def read_file(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def process_status(pid: int) -> tuple[str, int] | None:
    """Linux: (state letter of /proc/<pid>/stat, e.g. "R", "S", "T" stopped, "Z" zombie; the
    parent's pid), or None when there is no such process (or no /proc)."""
    fields = read_file(f"/proc/{pid}/stat").rpartition(")")[2].split()
    return (fields[0], int(fields[1])) if len(fields) > 1 else None


def state(pid: int | None) -> str:
    status = process_status(pid) if pid else None
    if status is not None and status[0] in "Tt":
        return "its process is stopped: SIGSTOP or a debugger"
    return "its process is running or waiting"


def kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


#: the signals that end a run gracefully: a scheduler's preemption (SIGTERM), Ctrl-C (SIGINT)
#: and a closed terminal or SSH session (SIGHUP, where the platform has it)
STOP_SIGNALS = tuple(
    s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None
)


class Forwarder:
    """While ranks run, SIGTERM / SIGINT / SIGHUP (``STOP_SIGNALS``) to the caller go to every live
    rank; a second one kills them. ``restore`` puts the caller's handlers back, then delivers the
    first signal received to the caller, so that it takes its usual effect once the ranks are gone.
    Installed only in the main thread, and not for a signal the caller ignores."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs, self.received, self.old = procs, [], {}
        self.owner = os.getpid()  # a forked rank runs this handler until it resets its own
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
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
