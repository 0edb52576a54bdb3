"""Under torchrun: after a collective failed, name the ranks on this machine that are stopped
(SIGSTOP, a debugger), and end them, so the job ends now; and end a worker whose agent died
(Linux only; docs/training.md)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

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


def _watch_agent(agent: int | None, period: float, grace: float) -> None:
    while agent is not None and os.getppid() == agent:
        time.sleep(period)
    print(
        f"fastpar: rank {os.environ.get('RANK', '?')}: its torchrun agent (pid {agent}) is gone; "
        f"stopping (SIGTERM to itself, then exit within {grace:g} s)",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)  # the step's end, a checkpoint if the peers answer
    time.sleep(grace)
    os._exit(1)  # the peers did not: end now rather than train as an orphan


def _is_agent(pid: int) -> bool:
    """Whether process ``pid`` runs torchrun (an agent can be PID 1 in a container)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read()
    except OSError:
        return False
    return b"torch.distributed.run" in line or b"torchrun" in line


_WATCHING: list[threading.Thread] = []


def exit_with_agent(period: float = 0.5, grace: float = 10.0) -> threading.Thread | None:
    """Under torchrun: a daemon thread that ends this worker when its agent dies (``kill -9``
    of one agent would leave its workers training as orphans, reparented): SIGTERM first (the
    run stops after its step, as on preemption), then ``os._exit`` after ``grace`` seconds. An
    agent already gone when this starts (reparented to a PID 1 that is not torchrun) counts as
    dead. Once per process."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not os.path.isdir("/proc"):
        return None
    if _WATCHING:
        return _WATCHING[0]
    agent: int | None = os.getppid()
    if agent == 1 and not _is_agent(1):
        agent = None
    thread = threading.Thread(
        target=_watch_agent, args=(agent, period, grace), daemon=True, name="agent-watch"
    )
    thread.start()
    _WATCHING.append(thread)
    return thread
