"""``python -m fastpar.parallel.pipeline [--stages 4] [--microbatches 8] [--virtual-stages 2]
[--group-size G] [--latency L] [--schedule NAME]``: draw every schedule's per-rank timeline
(GPipe, 1F1B, interleaved 1F1B with v chunks per rank in groups of G micro-batches, zero-bubble
ZB-H1 with its W steps, forward-only) and print the simulated bubble beside theory:
(p - 1) / (v m + p - 1), and (p - 1) / (3 m + p - 1) for ZB-H1 (F = B = W, the 1F1B backward
split in halves). ``--latency L``: every message between ranks takes L time units (a stage's
forward is 1) in the bubble table, which then also shows interleaved with G = 2p."""

from __future__ import annotations

from fastpar.cliutil import Parser
from fastpar.parallel.pipeline.schedules import (
    SCHEDULES,
    ForwardOnly,
    Interleaved,
    OneFOneB,
    ZeroBubbleH1,
)


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="python -m fastpar.parallel.pipeline", description=__doc__)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank (interleaved)")
    ap.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="interleaved: micro-batches per chunk in turn (default: the stages)",
    )
    ap.add_argument(
        "--latency",
        type=float,
        default=0.0,
        help="bubble table: time units a message between ranks takes (a stage forward is 1)",
    )
    ap.add_argument("--schedule", choices=("all", *SCHEDULES, ForwardOnly.name), default="all")
    args = ap.parse_args(argv)
    p, m, v, g, lat = (
        args.stages,
        args.microbatches,
        args.virtual_stages,
        args.group_size,
        args.latency,
    )
    # every training schedule of the registry (with the chunks where it takes them), then
    # forward-only
    every = {name: _maker(cls, m, v, g) for name, cls in SCHEDULES.items()}
    every[ForwardOnly.name] = lambda: ForwardOnly(m)
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
    print(f"{'schedule':>22} {'p':>3} {'m':>3} {'simulated':>10} {'theory':>15}")
    for pp in (2, 4):
        for mm in (4, 8, 16):
            table = [OneFOneB(mm), Interleaved(mm, 2), Interleaved(mm, 4), ZeroBubbleH1(mm)]
            if lat and 2 * pp <= mm:
                table[3:3] = [Interleaved(mm, 2, 2 * pp), Interleaved(mm, 4, 2 * pp)]
            for sched in table:
                name = type(sched).__name__
                if sched.virtual_stages > 1:
                    name += f" v={sched.virtual_stages}"
                    name += f" G={sched.group_size}" if sched.group_size else ""
                v_ = sched.virtual_stages  # a chunk's forward: 1 / v of the stage's
                simulated = sched.bubble_fraction(pp, 1 / v_, 2 / v_, latency=lat)
                print(f"{name:>22} {pp:>3} {mm:>3} {simulated:>10.3f} {sched.theory(pp):>15.3f}")


def _maker(cls, m: int, v: int, g: int | None):
    """A callable building ``cls`` for m micro-batches (v chunks in groups of g if chunked)."""
    return lambda: cls.build(m, v, g) if cls.chunked else cls.build(m)


if __name__ == "__main__":
    main()
