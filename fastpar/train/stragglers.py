"""Per-rank step times at each logged step, and the slowest rank: a slow rank shows before it
becomes a timeout. What is timed, and why ``rank_step_s`` is a lower bound: docs/debugging.md,
"Stragglers"."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from fastpar.comm import plain

#: the progress line names the slowest rank when it is this many times the median
SHOW_RATIO = 1.5


def rank_times(ready_s: float, wait_s: float, steps: int, device: torch.device) -> dict:
    """One all-gather over the default group of this rank's (``ready_s``, ``wait_s``) over
    ``steps`` steps: the row's ``rank_step_s`` (seconds per step until each rank arrived),
    ``rank_wait_s`` (seconds each waited for the others), ``slowest_rank`` and ``straggle``
    (its step time over the median of the other ranks')."""
    world = dist.get_world_size()
    mine = torch.tensor([ready_s / max(steps, 1), wait_s], dtype=torch.float64, device=device)
    if world == 1:
        rows = [mine.tolist()]
    else:
        out = torch.empty(2 * world, dtype=torch.float64, device=device)
        plain.all_gather_into_tensor(out, mine)
        rows = out.view(world, 2).tolist()
    step_s = [r[0] for r in rows]
    slowest = max(range(world), key=lambda r: (step_s[r], -rows[r][1]))
    others = [t for r, t in enumerate(step_s) if r != slowest] or step_s
    median = statistics.median(others)
    return {
        "rank_step_s": step_s,
        "rank_wait_s": [r[1] for r in rows],
        "slowest_rank": slowest,
        "straggle": step_s[slowest] / median if median > 0 else 1.0,
    }


def straggler_text(row: dict) -> str:
    """The progress line's note of a straggler ("" when none stands out)."""
    if row.get("straggle", 1.0) < SHOW_RATIO:
        return ""
    r = row["slowest_rank"]
    return f" | slowest rank {r}: {row['rank_step_s'][r]:.3g} s/step, {row['straggle']:.1f}x the median"
