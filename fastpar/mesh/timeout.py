"""The one collective timeout of a mesh: how long any collective of any of its groups may wait
for a peer (a stopped, stuck or dead rank) before it raises instead of hanging.

``init_process_group(timeout=…)`` covers the default group only: every ``new_group`` takes its
own ``timeout=``, or a stuck peer makes its members wait torch's default (30 minutes on gloo).
``ParallelMesh`` therefore passes one timeout to every group it creates.
"""

from __future__ import annotations

import contextlib
import math
from datetime import timedelta

import torch
import torch.distributed as dist

#: ``fastpar.init``'s collective timeout when none is given (``ParallelMesh`` without one takes
#: the default group's timeout, so a mesh built on ``fastpar.init`` uses this too)
DEFAULT_TIMEOUT = timedelta(minutes=10)


def as_timeout(value: timedelta | float | int) -> timedelta:
    """``value`` (a timedelta or seconds) as a positive, finite timedelta."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"timeout must be a datetime.timedelta or a number of seconds, got {value!r}"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {value!r}")
    return timedelta(seconds=seconds)


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The collective timeout ``group`` (default: the default group) was created with, read from
    its backend's options; None where this torch build does not expose it."""
    group = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            value = group._get_backend(torch.device(device)).options._timeout
            if isinstance(value, timedelta):
                return value
    return None
