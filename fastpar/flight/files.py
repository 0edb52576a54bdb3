"""Reading a run's dumps from a directory, waiting for them to come, and the analysis command
(``python -m fastpar.debug analyse DIR``)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import time

from fastpar.cliutil import Parser
from fastpar.flight.analyse import Analysis, analyse
from fastpar.flight.record import read_ring

PATTERN = re.compile(r"flight_rank(\d+)\.json$")
RING_PATTERN = re.compile(r"ring_rank(\d+)\.bin$")


def read_dumps(directory: str) -> list[dict]:
    """Every readable ``flight_rank<R>.json`` in ``directory``; for a rank without one, what its
    ring file ``ring_rank<R>.bin`` holds (a dict with ``partial: True``)."""
    out = _json_dumps(directory)
    have = {d.get("rank") for d in out}
    for path in sorted(glob.glob(os.path.join(directory, "ring_rank*.bin"))):
        m = RING_PATTERN.search(path)
        if m and int(m.group(1)) not in have:
            with contextlib.suppress(OSError):
                ring = read_ring(path)
                out.append({"rank": int(m.group(1)), "partial": True, "ring": ring})
    return out


def _json_dumps(directory: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "flight_rank*.json"))):
        if not PATTERN.search(path):
            continue
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return out


def collect(
    directory: str, ranks, timeout: float, since: float = 0.0, settle: float = 0.2
) -> list[dict]:
    """The dumps of ``ranks`` written after ``since`` (epoch seconds), waiting up to ``timeout``
    seconds for all of them (and ``settle`` s more for others); then whatever is there."""
    want = set(ranks)
    deadline = time.monotonic() + timeout
    while True:
        dumps = [d for d in read_dumps(directory) if d.get("partial") or d["time"] >= since]
        if want <= {d["rank"] for d in dumps if not d.get("partial")}:
            time.sleep(settle)  # a rank failing at the same moment is still writing its own
            return [d for d in read_dumps(directory) if d.get("partial") or d["time"] >= since]
        if time.monotonic() >= deadline:
            return dumps
        time.sleep(0.05)


def analyse_dir(directory: str, world_size: int | None = None, known=None) -> Analysis:
    return analyse(read_dumps(directory), world_size, known)


def main(argv=None) -> int:
    parser = Parser(
        prog="python -m fastpar.debug",
        description="Read the flight recorder's dumps (flight_rank<R>.json) of a failed run and "
        "name the first collective where the ranks disagree.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("analyse", help="analyse the dumps in DIR")
    a.add_argument("dir", metavar="DIR")
    a.add_argument("--world-size", type=int, default=None, help="ranks the run had")
    args = parser.parse_args(argv)
    dumps = read_dumps(args.dir)
    if not dumps:
        parser.error(f"no flight_rank<R>.json in {args.dir}")
    full = sorted(d["rank"] for d in dumps if not d.get("partial"))
    print(f"{len(full)} dumps in {args.dir} (ranks {full})")
    print(analyse(dumps, args.world_size).text())
    return 0
