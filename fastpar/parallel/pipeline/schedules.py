"""Pipeline schedules as data: per-rank ordered lists of steps ``(kind, micro-batch)`` or
``(kind, micro-batch, chunk)``, with a simulator and a text timeline. A new schedule is a new
order, not a new engine. Steps, chunks and their messages: docs/pipelines.md ("Schedules").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

Step = tuple  # ("F" | "B" | "W", micro-batch) or ("F" | "B", micro-batch, chunk)
Action = tuple[str, int, int]


@dataclass(frozen=True)
class Schedule:
    """``num_microbatches`` micro-batches per mini-batch. What a schedule can do is declared
    on its class, for callers to ask instead of testing names: ``name`` (its command-line
    name, the key of ``SCHEDULES``), ``chunked`` (it takes ``virtual_stages`` > 1 model chunks
    per rank), ``splits_backward``, ``forwards_first`` (every forward runs before any
    backward: each micro-batch's forward state waits for all of them), ``refuses`` (a feature
    of ``FEATURES`` it cannot run with -> why), ``accepts(feature)``, and per rank
    ``held`` / ``max_in_flight`` (what its forwards keep at the rank's peak)."""

    num_microbatches: int
    name: ClassVar[str] = ""
    virtual_stages: ClassVar[int] = 1  # model chunks per rank
    group_size: ClassVar[int | None] = None  # micro-batches a chunk runs in turn (chunked)
    chunked: ClassVar[bool] = False
    has_backward: ClassVar[bool] = True
    splits_backward: ClassVar[bool] = False  # steps "B" (input grad) and "W" (weight grad)
    forwards_first: ClassVar[bool] = False
    refuses: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @classmethod
    def accepts(cls, feature: str) -> bool:
        """Whether this schedule runs with ``feature`` (a key of ``FEATURES``)."""
        if feature not in FEATURES:
            raise ValueError(f"feature must be one of {sorted(FEATURES)}, got {feature!r}")
        return feature not in cls.refuses

    @classmethod
    def build(
        cls, num_microbatches: int, virtual_stages: int = 1, group_size: int | None = None
    ) -> Schedule:
        """This schedule from the trainer's options; ``virtual_stages`` and ``group_size``
        only for a ``chunked`` one."""
        if virtual_stages != 1:
            raise ValueError(
                f"virtual_stages {virtual_stages} needs the {chunked_names()} schedule, not "
                f"{cls.name}"
            )
        if group_size is not None:
            raise ValueError(
                f"group_size {group_size} needs the {chunked_names()} schedule, not {cls.name}"
            )
        return cls(num_microbatches)

    def __post_init__(self) -> None:
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ValueError(
                f"num_microbatches must be a positive integer, got {self.num_microbatches!r}"
            )

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        raise NotImplementedError

    def actions(self, num_stages: int, stage: int) -> list[Action]:
        """This rank's steps as ``(kind, micro-batch, chunk)``."""
        return [(s[0], s[1], s[2] if len(s) > 2 else 0) for s in self.steps(num_stages, stage)]

    def check(self, num_stages: int) -> None:
        """Raise ValueError when this schedule cannot run on ``num_stages`` ranks."""

    def forward_only(self) -> ForwardOnly:
        """The forward-only schedule (evaluation) of the same micro-batches and chunks."""
        return ForwardOnly(self.num_microbatches, self.virtual_stages, self.group_size)

    def max_in_flight(self, num_stages: int, stage: int) -> int:
        """Most (micro-batch, chunk) forwards that ran but whose backward has not, on this
        rank (over all its chunks)."""
        return int(self.held(num_stages, stage))

    def held(
        self,
        num_stages: int,
        stage: int,
        sizes: Sequence[float] | None = None,
        stored: Sequence[float] | None = None,
    ) -> float:
        """The peak, over this rank's steps, of what its forwards keep until their backward (a split
        backward's W, which frees the graph B kept): ``sizes[c]`` for each micro-batch of chunk c
        that ran forward and not yet backward (default 1 a chunk: chunk-forwards in flight), plus,
        for a schedule that ``splits_backward``, ``stored[c]`` for each whose B ran and W not (what
        B keeps for W: the output gradients, a recomputed graph; default nothing)."""
        v = self.virtual_stages
        sizes = [1.0] * v if sizes is None else list(sizes)
        stored = [0.0] * v if stored is None else list(stored)
        if len(sizes) != v or len(stored) != v:
            raise ValueError(f"{len(sizes)} sizes, {len(stored)} stored for {v} chunks a rank")
        live = peak = 0.0
        for kind, _, c in self.actions(num_stages, stage):
            if kind == "F":
                live += sizes[c]
            elif kind == "W":  # a split backward frees at W
                live -= sizes[c] + stored[c]
            elif self.splits_backward:
                live += stored[c]
            else:
                live -= sizes[c]
            peak = max(peak, live)
        return peak

    def cost(self, kind: str, forward: float, backward: float) -> float:
        """A step's uniform cost: a split backward's B and W each take half of ``backward``."""
        if kind == "F":
            return forward
        return backward / 2 if self.splits_backward else backward

    def simulate(
        self, num_stages: int, forward: float = 1.0, backward: float = 2.0, latency: float = 0.0
    ):
        """Start time of every step with uniform costs per step (``forward`` / ``backward``
        for one chunk's forward / backward of one micro-batch): a step starts when this rank
        is free and its input is ready (F on virtual stage s after F on s - 1; B on s after B
        on s + 1 and after its own F; W after its own B, B and W each half of ``backward``
        when the schedule splits it); an input from another rank arrives ``latency`` after
        the step that made it. Returns ({(rank, action): start}, makespan)."""
        p, v = num_stages, self.virtual_stages
        order = [self.actions(p, r) for r in range(p)]
        pos, free = [0] * p, [0.0] * p
        done: dict[tuple[int, Action], float] = {}
        start: dict[tuple[int, Action], float] = {}
        remaining = sum(len(o) for o in order)
        while remaining:
            progressed = False
            for r in range(p):
                if pos[r] == len(order[r]):
                    continue
                kind, i, c = act = order[r][pos[r]]
                s = c * p + r + (-1 if kind == "F" else 1)  # the virtual stage it depends on
                ready = 0.0
                if kind == "W":
                    ready = done[(r, ("B", i, c))]
                elif 0 <= s < p * v:
                    dep = (s % p, (kind, i, s // p))
                    if dep not in done:
                        continue
                    ready = done[dep] + (latency if dep[0] != r else 0.0)
                if kind == "B":
                    ready = max(ready, done[(r, ("F", i, c))])
                t0 = max(free[r], ready)
                start[(r, act)] = t0
                free[r] = done[(r, act)] = t0 + self.cost(kind, forward, backward)
                pos[r] += 1
                remaining -= 1
                progressed = True
            if not progressed:
                raise RuntimeError(f"{self!r} deadlocks on {p} stages at positions {pos}")
        return start, max(free)

    def bubble_fraction(
        self, num_stages: int, forward: float = 1.0, backward: float = 2.0, latency: float = 0.0
    ) -> float:
        """Idle fraction of each rank under uniform costs (equal on every rank), messages
        between ranks taking ``latency``."""
        _, makespan = self.simulate(num_stages, forward, backward, latency)
        acts = self.actions(num_stages, 0)
        busy = sum(self.cost(k, forward, backward) for k, _, _ in acts)
        return 1.0 - busy / makespan

    def theory(self, num_stages: int) -> float:
        """The textbook bubble fraction: (p - 1) / (v * m + p - 1)."""
        return (num_stages - 1) / (self.virtual_stages * self.num_microbatches + num_stages - 1)

    def timeline(self, num_stages: int, forward: int = 1, backward: int = 2) -> str:
        """A per-rank text timeline: one column per time unit, F/B with the micro-batch id
        (and ``.c``, the chunk, when ranks hold several), W for a split backward's weight
        gradient, '.' for idle."""
        start, makespan = self.simulate(num_stages, forward, backward)
        v = self.virtual_stages
        width = len(str(self.num_microbatches - 1)) + 1 + (len(str(v - 1)) + 1 if v > 1 else 0)
        chunks = f" x {v} chunks" if v > 1 else ""
        if self.group_size:
            chunks += f" in groups of {self.group_size} micro-batches"
        costs = f"B=W={backward / 2:g}" if self.splits_backward else f"B={backward}"
        lines = [
            f"{type(self).__name__}, {self.num_microbatches} micro-batches, {num_stages} stages"
            f"{chunks} (F={forward}, {costs} time units per step; bubble "
            f"{self.bubble_fraction(num_stages, forward, backward):.0%})"
        ]
        for r in range(num_stages):
            cells = ["." * width] * int(makespan)
            for (rank, (kind, i, c)), t0 in start.items():
                if rank == r:
                    label = f"{kind}{i}" + (f".{c}" if v > 1 else "")
                    for u in range(int(t0), int(t0 + self.cost(kind, forward, backward))):
                        cells[u] = label.ljust(width)
            lines.append(f"rank {r}: " + " ".join(cells))
        return "\n".join(lines)


class GPipe(Schedule):
    """All forwards, then all backwards (gradients accumulate); ``m`` micro-batches in flight.
    With recomputation only each micro-batch's stage input is kept (see the engine)."""

    name: ClassVar[str] = "gpipe"
    forwards_first: ClassVar[bool] = True

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        m = self.num_microbatches
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


class OneFOneB(Schedule):
    """Warm-up forwards (p - stage - 1 of them), then one forward / one backward, then the
    remaining backwards: at most p micro-batches in flight on the first stage, fewer later."""

    name: ClassVar[str] = "1f1b"

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


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B's order of forwards and input-gradient backwards (B),
    each weight gradient (W) deferred into what would be bubble (docs/pipelines.md)."""

    name: ClassVar[str] = "zb-h1"
    splits_backward: ClassVar[bool] = True
    refuses: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "selective_recompute": "the weight-gradient pass would unpack the checkpointed "
            "blocks' activations a second time and recompute them again (their collectives "
            "too)",
            "zero3": "ZeRO-3's gathers follow one backward per forward",
            "hf_config": "not supported yet",
            "fused_ce": "the fused linear cross-entropy is one autograd Function taking the "
            "head's weight and its input: its backward would run in both the B and the W pass "
            "(its collective twice)",
        }
    )

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        return _zb_h1(num_stages, self.num_microbatches)[stage]

    def theory(self, num_stages: int) -> float:
        """Unit costs F = B = W, m >= p: idle (p - 1) units per rank against 3 m busy."""
        p = num_stages
        return (p - 1) / (3 * self.num_microbatches + p - 1)


def _zb_h1(p: int, m: int) -> list[list[Step]]:
    fb = [[s for s in OneFOneB(m).steps(p, r)] for r in range(p)]
    limit = min(p, m)
    out: list[list[Step]] = [[] for _ in range(p)]
    done: dict[tuple, int] = {}  # (rank, kind, i) -> finish time
    pos, pending, live, t = [0] * p, [[] for _ in range(p)], [0] * p, 0
    while any(pos[r] < len(fb[r]) or pending[r] for r in range(p)):
        now = []
        for r in range(p):
            step = fb[r][pos[r]] if pos[r] < len(fb[r]) else None
            if step is not None:
                kind, i = step
                dep = (r - 1, "F", i) if kind == "F" else (r + 1, "B", i)
                ready = (dep[0] < 0 or dep[0] >= p or done.get(dep, t + 1) <= t) and (
                    kind == "F" or done.get((r, "F", i), t + 1) <= t
                )
                if ready and not (kind == "F" and live[r] >= limit):
                    pos[r] += 1
                    live[r] += kind == "F"
                    if kind == "B":
                        pending[r].append(i)
                    now.append((r, kind, i))
                    continue
            if pending[r]:
                i = pending[r].pop(0)
                live[r] -= 1
                now.append((r, "W", i))
        for r, kind, i in now:
            out[r].append((kind, i))
            done[(r, kind, i)] = t + 1
        t += 1
    return out


def _check_interleaved(m: int, v: int, p: int | None, name: str, g: int | None = None) -> None:
    """``p`` None: only what does not depend on the pipeline size. ``g``: the micro-batch
    group size (None: p)."""
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
    if g is not None and (not isinstance(g, int) or g < 1 or g > m):
        raise ValueError(
            f"{name}: group_size (micro-batches per chunk in turn) must be an integer in "
            f"[pp, num_microbatches = {m}], got {g!r}"
        )
    if g is not None and v == 1:
        raise ValueError(
            f"{name}: group_size {g} orders the chunks of an interleaved schedule; with 1 "
            "virtual stage there are none to order (drop group_size or use virtual_stages > 1)"
        )
    if p is None or v == 1:
        return
    if p == 1:
        raise ValueError(
            f"{name} with {v} virtual stages needs pp > 1 (one rank would send its chunks' "
            "activations to itself); use virtual_stages=1 or a pipeline of 2 or more ranks"
        )
    if g is None:
        if m % p:
            raise ValueError(
                f"{name} with {v} virtual stages needs the micro-batches ({m}) to be a multiple "
                f"of the pipeline size {p} (Megatron's interleaved order runs them in groups of "
                f"p); use {m + (-m) % p} micro-batches, virtual_stages=1, or a group_size whose "
                "last group holds at least p micro-batches"
            )
        return
    if g < p:
        raise ValueError(
            f"{name}: group_size {g} is smaller than the pipeline size {p}: a chunk's next "
            f"micro-batch would wait for its own previous one around the ring; use {p} or more"
        )
    if 0 < m % g < p:
        raise ValueError(
            f"{name}: {m} micro-batches in groups of {g} leave a last group of {m % g}, fewer "
            f"than the pipeline size {p} (it would stall the ring, as Megatron refuses too); "
            f"use a group size that divides {m} or leaves at least {p}"
        )


def _chunk_order(m: int, g: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """Megatron-Core's interleaved order of (micro-batch, chunk): micro-batches in groups of
    g (the pipeline size unless set; the last group takes the rest); within a group every
    chunk in turn (forward 0..v-1; backward v-1..0)."""
    out = []
    for g0 in range(0, m, g):
        group = range(g0, min(g0 + g, m))
        for c in range(v):
            out += [(i, v - 1 - c if backward else c) for i in group]
    return out


@dataclass(frozen=True)
class _Chunked(Schedule):
    """A schedule over ``virtual_stages`` model chunks a rank, ``group_size`` micro-batches a
    chunk in turn (None: the pipeline size)."""

    virtual_stages: int = 1
    group_size: int | None = None
    chunked: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check(None)

    def check(self, num_stages: int | None) -> None:
        m, v, g = self.num_microbatches, self.virtual_stages, self.group_size
        _check_interleaved(m, v, num_stages, type(self).__name__, g)

    def group(self, num_stages: int) -> int:
        """Micro-batches a chunk runs before the next chunk's turn: ``group_size``, else p."""
        return num_stages if self.group_size is None else self.group_size


@dataclass(frozen=True)
class Interleaved(_Chunked):
    """Interleaved 1F1B (Megatron-Core's ``forward_backward_pipelining_with_interleaving``)
    over ``virtual_stages`` chunks a rank placed round-robin; ``group_size`` is Megatron's
    ``microbatch_group_size_per_vp_stage``. Warm-up, bubble, latency: docs/pipelines.md."""

    virtual_stages: int = 2
    name: ClassVar[str] = "interleaved"
    refuses: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "zero3": "ZeRO-3 gathers around the whole stage's forward, model chunks run one by one",
            "hf_config": "not supported yet",
        }
    )

    @classmethod
    def build(
        cls, num_microbatches: int, virtual_stages: int = 1, group_size: int | None = None
    ) -> Schedule:
        return cls(num_microbatches, virtual_stages, group_size)

    def warmup(self, num_stages: int, stage: int) -> int:
        p, m, v = num_stages, self.num_microbatches, self.virtual_stages
        g = self.group(p)
        if m == p == g:
            return m * v
        return min((p - stage - 1) * 2 + (v - 1) * g, m * v)

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        self.check(num_stages)
        p, m, v = num_stages, self.num_microbatches, self.virtual_stages
        g = self.group(p)
        fwd = [("F", i, c) for i, c in _chunk_order(m, g, v, backward=False)]
        bwd = [("B", i, c) for i, c in _chunk_order(m, g, v, backward=True)]
        warm = self.warmup(p, stage)
        out: list[Step] = fwd[:warm]
        for k in range(m * v - warm):
            out += [fwd[warm + k], bwd[k]]
        return out + bwd[m * v - warm :]


@dataclass(frozen=True)
class ForwardOnly(_Chunked):
    """Forwards only, no backward (evaluation): micro-batch by micro-batch, or with
    ``virtual_stages`` > 1 chunks per rank in the order of ``Interleaved``'s forwards."""

    name: ClassVar[str] = "forward-only"
    has_backward: ClassVar[bool] = False

    def steps(self, num_stages: int, stage: int) -> list[Step]:
        self.check(num_stages)
        m, v = self.num_microbatches, self.virtual_stages
        if v == 1:
            return [("F", i) for i in range(m)]
        return [("F", i, c) for i, c in _chunk_order(m, self.group(num_stages), v, False)]


#: the training schedules by their command-line names (``Schedule.name``)
SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (GPipe, OneFOneB, Interleaved, ZeroBubbleH1)
}

#: what a schedule may ``refuse`` (the keys of ``Schedule.refuses``)
FEATURES = {
    "selective_recompute": "selective activation recomputation inside the blocks",
    "zero3": "a ZeRO-3 data-parallel wrapper (parameters gathered around its forward)",
    "hf_config": "a Hugging Face model's pipeline blocks",
    "sequence_parallel_tp": "sequence parallelism at tensor-parallel size > 1",
    "fused_ce": "the fused linear cross-entropy (--fused-ce) on a pipeline's last stage",
}


def chunked_names() -> str:
    """The training schedules that take model chunks (``chunked``), for messages."""
    return " or ".join(name for name, cls in SCHEDULES.items() if cls.chunked)


def accepting(feature: str) -> str:
    """The training schedules that run with ``feature`` (``Schedule.accepts``), for messages."""
    return " or ".join(name for name, cls in SCHEDULES.items() if cls.accepts(feature))


def make_schedule(
    name: str, num_microbatches: int, virtual_stages: int = 1, group_size: int | None = None
) -> Schedule:
    """The schedule called ``name`` (``SCHEDULES``); ``virtual_stages`` and ``group_size``
    only for a chunked one (interleaved)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name].build(num_microbatches, virtual_stages, group_size)
