"""One writer at a time per checkpoint directory (``DirectoryLock``: an flock with a heartbeat),
and no deletion of a checkpoint being read (``hold_for_reading`` / ``hold_for_deleting``).
Behaviour on one host and across hosts: docs/checkpoints.md ("Inside fastpar.checkpoint")."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time

from fastpar.checkpoint.format import MARKER, CheckpointError

try:
    import fcntl
except ImportError:  # not POSIX: no kernel locks, the file's content alone guards
    fcntl = None

LOCK_FILE = "LOCK"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0


class LockHeld(CheckpointError):
    """Another live writer holds the checkpoint directory."""


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux), to tell a reused pid
    from the original; None where /proc is not available."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``) runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    now = _process_start(pid)
    return start is None or now is None or now == start


def describe(holder: dict | None) -> str:
    """'run R (pid P on host H, since T, heartbeat S s ago)' for a lock file's content."""
    if not holder:
        return "an unknown holder (the lock file is empty or being written)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    beat = time.time() - float(holder.get("heartbeat", 0))
    return (
        f"run {holder.get('run_id')!r} (pid {holder.get('pid')} on host {holder.get('host')}, "
        f"since {since}, heartbeat {beat:.0f} s ago)"
    )


class DirectoryLock:
    """The write lock of ``directory`` (created if needed) for run ``run_id``. ``acquire()`` raises
    ``LockHeld`` naming a live holder, else takes the lock and returns the previous holder's content
    (None if never locked; ``taken_over`` tells whether that holder died without releasing it);
    ``check()`` raises unless the lock still names us; ``release()`` (idempotent) frees it."""

    def __init__(
        self,
        directory: str,
        run_id: str | None,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_FILE)
        self.run_id, self.heartbeat_s, self.stale_after_s = run_id, heartbeat_s, stale_after_s
        self._fd: int | None = None
        self._content: dict = {}
        self._stop = threading.Event()
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.taken_over = False

    def acquire(self) -> dict | None:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            previous = _read(fd)
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise LockHeld(self._refusal(previous, "it is alive")) from None
                previous = _read(fd)
            self._judge(previous)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        now = time.time()
        self._content = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "run_id": self.run_id,
            # the run whose checkpoints the directory holds, kept while the holder decides
            "last_run": self.run_id or (previous or {}).get("last_run"),
            "token": secrets.token_hex(8),
            "started": now,
            "heartbeat": now,
            "released": False,
        }
        try:
            self._write()
        except BaseException:  # (a full disk): not held
            os.close(fd)
            self._fd = None
            raise
        self._thread = threading.Thread(target=self._beat, name="fastpar-lock", daemon=True)
        self._thread.start()
        self.taken_over = bool(previous) and not previous.get("released")
        return previous

    def _judge(self, previous: dict | None) -> None:
        """With the flock taken: raise if the previous holder may still be alive."""
        if not previous or previous.get("released"):
            return
        pid, host = previous.get("pid"), previous.get("host")
        if host == socket.gethostname():
            if (
                pid != os.getpid()
                and isinstance(pid, int)
                and _alive(pid, previous.get("pid_start"))
            ):
                raise LockHeld(
                    self._refusal(previous, "it is alive (this filesystem ignores flock)")
                )
            return
        age = time.time() - float(previous.get("heartbeat", 0))
        if age < self.stale_after_s:
            raise LockHeld(
                self._refusal(
                    previous,
                    f"it runs on another host and its heartbeat is {age:.0f} s old (taken over "
                    f"as stale after {self.stale_after_s:.0f} s without one; or delete "
                    f"{self.path} if that run is dead)",
                )
            )

    def _refusal(self, holder: dict | None, why: str) -> str:
        return (
            f"checkpoint directory {self.directory} is locked by {describe(holder)}: {why}; two "
            f"runs must not write one directory — wait for that run to end, stop it, or use "
            f"another --checkpoint-dir"
        )

    def update(self, **fields) -> None:
        """Change fields of the lock's content (e.g. the run id once decided)."""
        if "run_id" in fields:
            self.run_id = fields["last_run"] = fields["run_id"]
        self._content.update(fields)
        self._write()

    def check(self) -> None:
        """Raise unless the lock file still names this holder (a writer on another host may
        have taken a lock it judged stale)."""
        with self._write_lock:  # (not half way through the heartbeat's rewrite)
            current = _read(self._fd) if self._fd is not None else None
        if not current or current.get("token") != self._content.get("token"):
            raise LockHeld(
                f"this run lost the lock on {self.directory} to {describe(current)}; it stops "
                f"writing checkpoints there"
            )

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._content.update(released=True, heartbeat=time.time())
            self._write()
        os.close(self._fd)  # drops the flock
        self._fd = None

    def _write(self) -> None:
        with self._write_lock:
            if self._fd is None:
                return
            data = json.dumps(self._content).encode()
            # over the old content, then cut to length: truncating first would give the
            # file's block back, and on a full disk another writer may take it before ours
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
            os.fsync(self._fd)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):
                self._content["heartbeat"] = time.time()
                self._write()


def _read(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 1 << 16, 0)
        return json.loads(data) if data else None
    except (OSError, ValueError):
        return None


def _hold(checkpoint: str, exclusive: bool) -> tuple:
    """(the marker opened and flock'ed, None) / (None, True) if someone holds it the other way
    / (None, False) without a marker."""
    try:
        f = open(os.path.join(checkpoint, MARKER), "rb")  # noqa: SIM115 (held until closed)
    except OSError:
        return None, False
    if fcntl is not None:
        try:
            fcntl.flock(f.fileno(), (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None, True
    return f, False


def hold_for_reading(checkpoint: str):
    """A shared lock on ``checkpoint``'s marker (an open file: close it to let go), or None when
    there is no marker (the reader then reports what is missing)."""
    f, busy = _hold(checkpoint, exclusive=False)
    if busy:
        raise CheckpointError(
            f"checkpoint {checkpoint} is being deleted (--keep-last) and cannot be read"
        )
    return f


def hold_for_deleting(checkpoint: str):
    """An exclusive lock on ``checkpoint``'s marker, or None if someone reads it (or it has
    no marker)."""
    return _hold(checkpoint, exclusive=True)[0]
