"""Processes: a command run as a user runs it (``run_python``, ``run_module``), and processes
seen through Linux's /proc, for the tests that signal ranks and launchers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from fastpar.testing import process_status

#: the repository: the commands run from it, with it on PYTHONPATH (this checkout's fastpar)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(*args, timeout: float = 180, env=None) -> subprocess.CompletedProcess:
    """``python *args`` from the repository, its output captured as text; ``env`` on top of
    this process's environment."""
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def run_module(module: str, *argv, timeout: float = 180, env=None) -> subprocess.CompletedProcess:
    """``python -m module *argv``, as ``run_python`` runs it."""
    return run_python("-m", module, *argv, timeout=timeout, env=env)


def children(parent: int) -> dict[int, tuple[str, str]]:
    """{pid: (name, command line)} of ``parent``'s live (not zombie) children."""
    out = {}
    for entry in os.listdir("/proc"):
        status = process_status(int(entry)) if entry.isdigit() else None
        if status is not None and status[1] == parent and status[0] != "Z":
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = (name, f.read().replace(b"\0", b" ").decode())
    return out


def alive(pids, seconds: float = 10.0) -> list[int]:
    """The pids still running (zombies count as gone) after waiting up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if (process_status(p) or ("Z", 0))[0] != "Z"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
