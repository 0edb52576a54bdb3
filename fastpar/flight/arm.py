"""Dump on request: ``arm(directory)`` makes SIGUSR1 write this rank's records there at once,
even while the main thread is blocked inside a collective (a Python signal handler would wait
for the collective to return): the signal's byte reaches a small thread through
``signal.set_wakeup_fd``, and that thread writes the dump."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

from fastpar.flight.record import dump, enabled, open_ring

_ARMED: dict = {}


def _noop(signum, frame) -> None:  # the main thread's share of SIGUSR1: nothing
    return None


def _serve(sock: socket.socket, directory: str) -> None:
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGUSR1 in data:
            with contextlib.suppress(Exception):
                dump(_ARMED.get("dir", directory), "SIGUSR1")


def arm(directory: str, rank: int) -> bool:
    """From now on SIGUSR1 dumps this rank's records into ``directory`` (main thread only, once
    per process; not when a wakeup fd is already set, e.g. by asyncio), and fastpar's ring is
    kept in a file there (``open_ring``). Returns whether SIGUSR1 is armed."""
    if not enabled():
        return False
    open_ring(directory, rank)  # (where the disk has no room: in memory only, one line says so)
    # NCCL: torch's own dump on a watchdog timeout lands beside fastpar's (read at group creation)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(directory, "torch_fr_rank"))
    if threading.current_thread() is not threading.main_thread():
        return False
    if _ARMED.get("pid") == os.getpid():
        _ARMED["dir"] = directory
        return True
    read_end, write_end = socket.socketpair()
    write_end.setblocking(False)
    signal.signal(signal.SIGUSR1, _noop)
    try:
        old = signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
    except ValueError:
        return False
    if old != -1:  # someone else's wakeup fd: leave it
        signal.set_wakeup_fd(old)
        read_end.close()
        write_end.close()
        return False
    _ARMED.update(pid=os.getpid(), dir=directory, sockets=(read_end, write_end))
    threading.Thread(
        target=_serve, args=(read_end, directory), daemon=True, name="fastpar-flight"
    ).start()
    return True


def directory() -> str | None:
    """Where this process dumps (None when not armed)."""
    return _ARMED.get("dir") if _ARMED.get("pid") == os.getpid() else None
