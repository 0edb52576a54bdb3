"""Pipeline schedules as lists of steps, with a per-rank text timeline.

A step is ("F", i) — forward of micro-batch i on this stage — or ("B", i) — its backward.
Communication is implied: a forward receives from the previous stage and sends to the next,
a backward receives the output gradient from the next stage and sends the input gradient back.
``print(OneFOneB(8).timeline(4))`` draws the schedule; ``python -m fastpar.parallel.pipeline``
prints both schedules and the bubble table.
"""

from __future__ import annotations

from dataclasses import dataclass

Step = tuple[str, int]


@dataclass(frozen=True)
class Schedule:
    """``num_microbatches`` micro-batches per mini-batch."""

    num_microbatches: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ValueError(
                f"num_microbatches must be a positive integer, got {self.num_microbatches!r}"
            )

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        raise NotImplementedError

    def max_in_flight(self, num_stages: int, stage: int) -> int:
        """Most micro-batches whose forward ran but whose backward has not, on this stage."""
        live = peak = 0
        for kind, _ in self.steps(num_stages, stage):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        return peak

    def simulate(self, num_stages: int, forward: float = 1.0, backward: float = 2.0):
        """Start time of every step with uniform costs: a step starts when this stage is free
        and its input is ready (F(i) after F(i) on the stage before; B(i) after B(i) on the
        stage after). Returns ({(stage, step): start}, makespan)."""
        order = [self.steps(num_stages, s) for s in range(num_stages)]
        pos = [0] * num_stages
        free = [0.0] * num_stages
        done: dict[tuple[int, Step], float] = {}
        start: dict[tuple[int, Step], float] = {}
        remaining = sum(len(o) for o in order)
        while remaining:
            progressed = False
            for s in range(num_stages):
                if pos[s] == len(order[s]):
                    continue
                kind, i = step = order[s][pos[s]]
                dep = (s - 1, ("F", i)) if kind == "F" else (s + 1, ("B", i))
                ready = 0.0
                if 0 <= dep[0] < num_stages:
                    if dep not in done:
                        continue
                    ready = done[dep]
                if kind == "B":
                    ready = max(ready, done[(s, ("F", i))])
                t0 = max(free[s], ready)
                start[(s, step)] = t0
                free[s] = done[(s, step)] = t0 + (forward if kind == "F" else backward)
                pos[s] += 1
                remaining -= 1
                progressed = True
            if not progressed:  # pragma: no cover - a schedule bug, not a user error
                raise RuntimeError(f"{type(self).__name__} deadlocks at positions {pos}")
        return start, max(free)

    def bubble_fraction(
        self, num_stages: int, forward: float = 1.0, backward: float = 2.0
    ) -> float:
        """Idle fraction of each stage under uniform costs (equal on every stage)."""
        _, makespan = self.simulate(num_stages, forward, backward)
        busy = self.num_microbatches * (forward + backward)
        return 1.0 - busy / makespan

    def timeline(self, num_stages: int, forward: int = 1, backward: int = 2) -> str:
        """A per-rank text timeline: one column per time unit, F/B with the micro-batch id,
        '.' for idle."""
        start, makespan = self.simulate(num_stages, forward, backward)
        width = len(str(self.num_microbatches - 1)) + 1
        lines = [f"{type(self).__name__}, {self.num_microbatches} micro-batches, {num_stages} stages "
                 f"(F={forward}, B={backward} time units; bubble "
                 f"{self.bubble_fraction(num_stages, forward, backward):.0%})"]  # fmt: skip
        for s in range(num_stages):
            cells = ["." * width] * int(makespan)
            for (stage, (kind, i)), t0 in start.items():
                if stage == s:
                    for u in range(int(t0), int(t0) + (forward if kind == "F" else backward)):
                        cells[u] = f"{kind}{i}".ljust(width)
            lines.append(f"rank {s}: " + " ".join(cells))
        return "\n".join(lines)


class GPipe(Schedule):
    """All forwards, then all backwards (gradients accumulate); ``m`` micro-batches in flight.
    With recomputation only each micro-batch's stage input is kept (see the engine)."""

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        m = self.num_microbatches
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


class OneFOneB(Schedule):
    """Warm-up forwards (p - stage - 1 of them), then one forward / one backward, then the
    remaining backwards: at most p micro-batches in flight on the first stage, fewer later."""

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        m = self.num_microbatches
        warm = min(num_stages - stage - 1, m)
        out: list[Step] = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            out.append(("F", f))
            f += 1
            out.append(("B", b))
            b += 1
        out += [("B", i) for i in range(b, m)]
        return out
