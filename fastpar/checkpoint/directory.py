"""A directory of a run's checkpoints, ``<root>/step_<N>`` (N zero-padded to 6 digits, longer
past 999,999): listed in the numeric order of the steps, judged one by one (complete,
incomplete, corrupted; whose run), pruned to the newest N.

    entries = scan(root)                    # [Entry], oldest step first
    path = latest_checkpoint(root)          # the newest complete one (fully verified), or None
    deleted, busy = prune(root, keep=3, run_id=run, protect=just_written)
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from fastpar.checkpoint.core import verify
from fastpar.checkpoint.format import PARTIAL_SUFFIX, CheckpointError, read_metadata
from fastpar.checkpoint.lock import hold_for_deleting

_STEP = re.compile(r"step_(\d+)")


def step_dir(root: str, step: int) -> str:
    """``<root>/step_<step>``, zero-padded to 6 digits."""
    return os.path.join(root, f"step_{step:06d}")


@dataclass
class Entry:
    """One ``step_<N>`` directory: ``status`` "complete" (marker, metadata checksum and file
    sizes check out; contents are checksummed by ``verify``), "incomplete" (a save that did not
    finish: no marker, or a ``.partial`` directory) or "corrupted" (``reason`` says which
    file); ``run_id`` and ``saved_at`` of a complete one."""

    path: str
    step: int
    status: str
    reason: str = ""
    run_id: str | None = None
    saved_at: float = 0.0

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def _judge(path: str, step: int) -> Entry:
    if path.endswith(PARTIAL_SUFFIX):
        return Entry(path, step, "incomplete", "a save that did not finish (.partial)")
    try:
        meta = read_metadata(path)
    except CheckpointError as e:
        text = str(e)
        if "no completion marker" in text:
            return Entry(path, step, "incomplete", "no completion marker: the save did not finish")
        return Entry(path, step, "corrupted", text.split(": ", 1)[-1])
    return Entry(path, step, "complete", "", meta.get("run_id"), float(meta.get("saved_at", 0)))


def scan(root: str) -> list[Entry]:
    """Every ``step_<N>`` directory (and ``step_<N>.partial``) of ``root``, by step, then the
    finished one after its partial; [] if ``root`` does not exist."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        base = name[: -len(PARTIAL_SUFFIX)] if name.endswith(PARTIAL_SUFFIX) else name
        m = _STEP.fullmatch(base)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), base != name, path))
    found.sort(key=lambda t: (t[0], not t[1]))
    return [_judge(path, step) for step, _, path in found]


def latest_checkpoint(root: str, run_id: str | None = None) -> str | None:
    """The newest (highest step) complete checkpoint in ``root`` that verifies in full (every
    file's sha256), of run ``run_id`` if given; None if there is none."""
    for entry in reversed(scan(root)):
        if entry.status != "complete" or (run_id is not None and entry.run_id != run_id):
            continue
        try:
            verify(entry.path)
        except CheckpointError:
            continue
        return entry.path
    return None


def prune(root: str, keep: int, *, run_id: str | None, protect: str) -> tuple[list, list]:
    """Delete complete checkpoints of run ``run_id`` beyond the newest ``keep`` (by step),
    never ``protect`` (the one just written) nor one being read. Returns (deleted, kept because
    being read) as paths. Incomplete, corrupted and other runs' checkpoints are left alone."""
    ours = [e for e in scan(root) if e.status == "complete" and e.run_id == run_id]
    protect = os.path.abspath(protect)
    old = [e for e in ours[: max(0, len(ours) - keep)] if os.path.abspath(e.path) != protect]
    deleted, busy = [], []
    for entry in old:
        hold = hold_for_deleting(entry.path)
        if hold is None:
            busy.append(entry.path)
            continue
        try:
            doomed = entry.path + ".deleting"
            shutil.rmtree(doomed, ignore_errors=True)  # left by a crash in an earlier prune
            os.replace(entry.path, doomed)  # out of sight of scans before the slow part
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(entry.path)
        finally:
            hold.close()
    return deleted, busy
