"""``python -m fastpar.parallel.pipeline [--stages 4] [--microbatches 8]``: draw GPipe and 1F1B
timelines and print the simulated bubble beside (p - 1) / (m + p - 1)."""

from __future__ import annotations

import argparse

from fastpar.parallel.pipeline.schedules import GPipe, OneFOneB


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastpar.parallel.pipeline", description=__doc__)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args(argv)
    p, m = args.stages, args.microbatches
    for sched in (GPipe(m), OneFOneB(m)):
        print(sched.timeline(p))
        print(
            f"  micro-batches in flight per rank: {[sched.max_in_flight(p, s) for s in range(p)]}\n"
        )
    print(f"{'p':>3} {'m':>3} {'simulated':>10} {'(p-1)/(m+p-1)':>14}")
    for pp in (2, 4):
        for mm in (1, 2, 4, 8, 16):
            print(
                f"{pp:>3} {mm:>3} {OneFOneB(mm).bubble_fraction(pp):>10.3f} {(pp - 1) / (mm + pp - 1):>14.3f}"
            )


if __name__ == "__main__":
    main()
