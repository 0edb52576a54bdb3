"""Ending a run early, alike on every rank: preemption (SIGTERM / SIGINT, and SIGHUP: a closed
terminal) and divergence. A signal only raises a flag; ``agree`` at the next sync point stops
every rank after the same step for the same cause (docs/training.md, "Inside fastpar.train")."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from fastpar.comm import plain
from fastpar.launch.procs import STOP_SIGNALS  # (SIGTERM, SIGINT, SIGHUP)


class RunStopped(SystemExit):
    """The run ended before its last step: preempted by a signal, or diverged.

    A ``SystemExit``: uncaught, it ends the program with status 1 and its message on stderr.
    Attributes: ``step`` (the last step run), ``cause`` (e.g. "SIGTERM", "non-finite loss"),
    ``checkpoint`` (where the step was saved, or None).
    """

    def __init__(self, message: str, step: int, cause: str, checkpoint: str | None = None):
        super().__init__(message)
        self.message, self.step, self.cause, self.checkpoint = message, step, cause, checkpoint

    def __reduce__(self):  # pickled from a rank to the launcher
        return type(self), (self.message, self.step, self.cause, self.checkpoint)

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """While active (a context manager), SIGTERM, SIGINT and SIGHUP set ``received`` (the first signal's
    number) instead of ending the process; the previous handlers come back on exit. Only the
    main thread can catch signals: elsewhere this does nothing."""

    def __init__(self) -> None:
        self.received = 0
        self._old: dict[int, Any] = {}

    def _catch(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                old = signal.getsignal(sig)
                if old is not signal.SIG_IGN and old is not None:
                    self._old[sig] = old
                    signal.signal(sig, self._catch)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def agree(
    signum: int, diverged: bool, mem_mib: float, device: torch.device
) -> tuple[int, bool, float]:
    """One MAX all-reduce over the default group: (the largest signal number any rank received,
    0 for none; whether any rank found a divergence; the largest peak memory in MiB)."""
    flags = torch.tensor([float(signum), float(diverged), float(mem_mib)], device=device)
    plain.all_reduce(flags, op=dist.ReduceOp.MAX)
    sig, bad, mem = flags.tolist()
    return int(sig), bad > 0, mem


def weights_fit(tensors, dtype: torch.dtype, device: torch.device) -> bool:
    """True on every rank when every element of every rank's ``tensors`` is finite in ``dtype``
    (fp32 masters of an fp16 model must fit fp16). One MIN all-reduce over the default group."""
    peaks = [t.detach().abs().amax().float().to(device) for t in tensors if t.numel()]
    peak = torch.stack(peaks).max() if peaks else torch.zeros((), device=device)
    flag = (peak <= torch.finfo(dtype).max).float().reshape(1)  # False for inf and NaN
    plain.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
