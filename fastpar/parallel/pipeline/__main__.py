"""``python -m fastpar.parallel.pipeline [--stages 4] [--microbatches 8] [--virtual-stages 2]
[--schedule NAME]``: draw every schedule's per-rank timeline (GPipe, 1F1B, interleaved 1F1B
with v chunks per rank, zero-bubble ZB-H1 with its W steps, forward-only) and print the
simulated bubble beside theory: (p - 1) / (v m + p - 1), and (p - 1) / (3 m + p - 1) for ZB-H1
(F = B = W, the 1F1B backward split in halves)."""

from __future__ import annotations

import argparse

from fastpar.parallel.pipeline.schedules import (
    ForwardOnly,
    GPipe,
    Interleaved,
    OneFOneB,
    ZeroBubbleH1,
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastpar.parallel.pipeline", description=__doc__)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank (interleaved)")
    ap.add_argument(
        "--schedule", choices=("all", "gpipe", "1f1b", "interleaved", "zb-h1", "forward-only"),
        default="all",
    )  # fmt: skip
    args = ap.parse_args(argv)
    p, m, v = args.stages, args.microbatches, args.virtual_stages
    every = {
        "gpipe": lambda: GPipe(m),
        "1f1b": lambda: OneFOneB(m),
        "interleaved": lambda: Interleaved(m, v),
        "zb-h1": lambda: ZeroBubbleH1(m),
        "forward-only": lambda: ForwardOnly(m),
    }
    for name, make in every.items():
        if args.schedule not in ("all", name):
            continue
        try:
            sched = make()
            sched.check(p)
        except ValueError as exc:
            print(f"{name}: {exc}\n")
            continue
        print(sched.timeline(p))
        inflight = [sched.max_in_flight(p, s) for s in range(p)]
        print(f"  chunk-forwards in flight per rank: {inflight}\n")
    print(f"{'schedule':>16} {'p':>3} {'m':>3} {'simulated':>10} {'theory':>15}")
    for pp in (2, 4):
        for mm in (4, 8, 16):
            for sched in (OneFOneB(mm), Interleaved(mm, 2), Interleaved(mm, 4), ZeroBubbleH1(mm)):
                name = type(sched).__name__ + (
                    f" v={sched.virtual_stages}" if sched.virtual_stages > 1 else ""
                )
                print(
                    f"{name:>16} {pp:>3} {mm:>3} {sched.bubble_fraction(pp):>10.3f} "
                    f"{sched.theory(pp):>15.3f}"
                )


if __name__ == "__main__":
    main()
