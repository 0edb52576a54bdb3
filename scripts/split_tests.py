"""Split the CPU tier's test files between the queues of ``scripts/run_tests.sh``.

    python scripts/split_tests.py QUEUES K [EXTRA_JOB=SECONDS ...]   # queue K's share
    python scripts/split_tests.py --record JUNIT.xml                  # refresh the weights

Each file weighs its seconds in ``scripts/test_seconds.txt`` (one serial run of the CPU tier on
a 2-core machine; a file not listed weighs the median). Longest first, each file goes to the
queue with the least so far (the longest-processing-time rule), after the extra jobs (the
second kernel path, the interpreter tier: ``name=seconds``) have been placed the same way.
Prints queue K's files, one a line, then ``job:NAME`` for each extra job it runs. The split is
only a schedule: every file runs in exactly one queue whatever the weights say.
"""

from __future__ import annotations

import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "scripts" / "test_seconds.txt"


def weights() -> dict[str, float]:
    out = {}
    if WEIGHTS.is_file():
        for line in WEIGHTS.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                seconds, path = line.split()
                out[path] = float(seconds)
    return out


def split(files: list[str], queues: int, jobs: dict[str, float]) -> list[list[str]]:
    known = weights()
    default = statistics.median(known.values()) if known else 1.0
    items = [(s, f"job:{name}") for name, s in jobs.items()]
    items += [(known.get(f, default), f) for f in files]
    load = [0.0] * queues
    share: list[list[str]] = [[] for _ in range(queues)]
    for seconds, item in sorted(items, key=lambda x: (-x[0], x[1])):
        k = load.index(min(load))
        load[k] += seconds
        share[k].append(item)
    return share


def record(junit: str) -> None:
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0))
    lines = [f"{s:.1f} {p}" for p, s in sorted(seconds.items())]
    head = "# seconds per test file, one serial CPU-tier run (scripts/split_tests.py --record)\n"
    WEIGHTS.write_text(head + "\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--record":
        record(argv[1])
        return 0
    if len(argv) < 2 or not argv[0].isdigit() or not argv[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    queues, k = int(argv[0]), int(argv[1])
    if not 0 <= k < queues:
        print(f"queue {k} does not exist: 0 <= K < {queues}", file=sys.stderr)
        return 2
    jobs = {}
    for job in argv[2:]:
        name, _, seconds = job.partition("=")
        jobs[name] = float(seconds)
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    mine = split(files, queues, jobs)[k]
    print("\n".join(sorted(f for f in mine if not f.startswith("job:"))))
    print("\n".join(f for f in mine if f.startswith("job:")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
