"""Under torchrun: after a collective failed, name the ranks on this machine that are stopped
(SIGSTOP, a debugger), and end them, so the job ends now (Linux only; docs/training.md)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from fastpar.launch import process_status


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in items if b"=" in item)
    return {k: v for k, _, v in pairs}


def stopped_siblings() -> list[tuple[int, int]]:
    """(rank, pid) of each other rank of this torchrun job under the same agent whose process is
    stopped."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or not os.path.isdir("/proc"):
        return []
    me, agent = os.getpid(), os.getppid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        status = process_status(int(name))
        if status is None or status[1] != agent or status[0] not in "Tt":
            continue
        env = _environ(int(name))
        if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("RANK", "").isdigit():
            found.append((int(env["RANK"]), int(name)))
    return sorted(found)


def end_stopped_siblings() -> list[int]:
    """Name each stopped sibling rank on stderr and SIGKILL it; returns their ranks."""
    ranks = []
    for rank, pid in stopped_siblings():
        print(
            f"fastpar: no answer from rank {rank} (pid {pid}): its process is stopped (SIGSTOP "
            "or a debugger); ending it so that the job ends now",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        ranks.append(rank)
    return ranks
