"""The flight recorder: what each rank's collectives were, dumped when a run fails, and one
analysis of the dumps naming the first collective where the ranks disagree (docs/debugging.md).

    python -m fastpar.debug analyse DIR      # the analysis of the dumps in DIR
"""

from __future__ import annotations

from fastpar.flight.analyse import Analysis, Finding, analyse
from fastpar.flight.arm import arm
from fastpar.flight.files import analyse_dir, collect, read_dumps
from fastpar.flight.record import dump, enabled, name_group, note_p2p, note_splits, snapshot

__all__ = [
    "Analysis",
    "Finding",
    "analyse",
    "analyse_dir",
    "arm",
    "collect",
    "dump",
    "enabled",
    "name_group",
    "note_p2p",
    "note_splits",
    "read_dumps",
    "snapshot",
]
