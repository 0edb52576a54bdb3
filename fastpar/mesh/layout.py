"""The pure rank layout: which ranks form each TP / CP / PP / DP / EP group. No torch.distributed.

One ``order`` string (first axis fastest, default ``"tp-ep-dp-pp"``) lays out the dense and the
expert grid, with Megatron-Core's group lists; orders whose grids would not line up are
refused (docs/layouts.md, "Rank order and the two grids"). Hybrid sharding splits the dp axis
in two, ``dp = dp_shard × dp_replicate``, ``dp_shard`` the faster (docs/layouts.md, "Hybrid
sharding")."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""Megatron-Core's default; a layout without context parallelism spells it "tp-ep-dp-pp"."""

#: The group kinds ``rank_groups`` returns, and what each is for.
GROUP_KINDS = {
    "tp": "tensor parallel: ranks that split one layer's weights",
    "pp": "pipeline parallel: one rank per stage, first stage first",
    "dp": "data parallel: replicas of the same dense weights",
    "mp": "model parallel (tp × pp): one full copy of the model",
    "tp-dp": "tensor × data parallel: ranks that hold one pipeline stage",
    "embedding": "first and last pipeline stage (tied embedding / LM head); first only if pp = 1",
    "cp": "context parallel: ranks that hold chunks of one sequence",
    "dp-cp": "data × context parallel: the ranks dense gradients are averaged over",
    "dp-shard": "hybrid sharding: the dp ranks that shard one copy (consecutive dp ranks)",
    "dp-replicate": "hybrid sharding: one rank of each dp-shard group, same shard (dp / dp-shard)",
    "dp-shard-cp": "dp-shard × context parallel: the ranks ZeRO shards dense parameters over",
    "tp-cp": "tensor × context parallel: one sequence's ranks in one replica and stage",
    "ep": "expert parallel: ranks that split the experts of one MoE layer",
    "expert-dp": "expert data parallel: replicas of the same experts (dp·cp / ep ranks)",
    "expert-dp-shard": "hybrid sharding of experts: the expert-dp ranks of one dp-shard-cp block",
    "expert-dp-replicate": "hybrid sharding of experts: one rank of each expert-dp-shard group",
    "tp-ep": "expert tensor × expert parallel: ranks that hold one stage's experts",
}


def parse_order(order: str) -> tuple[str, ...]:
    """Split and check an order string such as ``"tp-cp-ep-dp-pp"``.

    Every one of tp, ep, dp and pp must appear exactly once (the first varies fastest); cp at
    most once (left out: right after tp).
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a string such as {DEFAULT_ORDER!r}, got {order!r}")
    tokens = tuple(t.strip().lower() for t in order.split("-"))
    fix = f"use each of {'/'.join(DIMENSIONS)} exactly once, e.g. {DEFAULT_ORDER!r}"
    unknown = [t for t in tokens if t not in DIMENSIONS]
    if unknown:
        raise ValueError(f"order {order!r} has unknown token(s) {unknown}; {fix}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order {order!r} repeats {repeated}; {fix}")
    if "cp" not in tokens:
        at = tokens.index("tp") + 1 if "tp" in tokens else 0
        tokens = (*tokens[:at], "cp", *tokens[at:])
    missing = [d for d in DIMENSIONS if d not in tokens]
    if missing:
        raise ValueError(f"order {order!r} is missing {missing}; {fix}")
    return tokens


def grid_groups(sizes: dict[str, int], order: tuple[str, ...], axes: str) -> list[list[int]]:
    """Groups spanned by ``axes`` (e.g. ``"tp-dp"``) on the grid ``sizes`` laid out by ``order``.

    A rank's index is sum(coord[d] * stride[d]) with stride[d] the product of the sizes of the
    axes before d in ``order``. One group per combination of the other axes' coordinates
    (enumerated with the earliest axis fastest); inside a group, members are enumerated the
    same way over the spanned axes, so every group lists its ranks in increasing order of the
    spanned coordinates.
    """
    span = axes.split("-")
    stride, acc = {}, 1
    for d in order:
        stride[d] = acc
        acc *= sizes[d]
    inside = [d for d in order if d in span]
    outside = [d for d in order if d not in span]

    def offsets(dims: list[str]) -> list[int]:
        # itertools.product varies its last argument fastest, so feed the dims reversed.
        ranges = [range(sizes[d]) for d in reversed(dims)]
        return [
            sum(c * stride[d] for c, d in zip(coords, reversed(dims), strict=True))
            for coords in itertools.product(*ranges)
        ]

    members = offsets(inside)
    return [[base + m for m in members] for base in offsets(outside)]


def _pipeline_mismatch(dense_pp: list[list[int]], expert_pp: list[list[int]]) -> str:
    """Why two grids' differing pipeline groups matter, naming a rank (its stage if it moves)."""
    dense_of = {r: (s, g) for g in dense_pp for s, r in enumerate(g)}
    expert_of = {r: (s, g) for g in expert_pp for s, r in enumerate(g)}
    for r, (ds, _) in sorted(dense_of.items()):
        es = expert_of[r][0]
        if ds != es:
            return (
                f"rank {r} is in stage {ds} of the dense grid but stage {es} of the expert grid, "
                f"so expert groups would span pipeline stages"
            )
    r = next(r for r in sorted(dense_of) if dense_of[r][1] != expert_of[r][1])
    return (
        f"rank {r}'s pipeline is {dense_of[r][1]} in the dense grid but {expert_of[r][1]} in "
        f"the expert grid"
    )


def resolve_dp(
    dp: int | None,
    dp_shard: int | None,
    dp_replicate: int | None,
    names: tuple[str, str, str] = ("dp", "dp_shard", "dp_replicate"),
) -> tuple[int | None, int | None, int | None]:
    """Any two of ``dp``, ``dp_shard`` and ``dp_replicate`` determine the third
    (dp = dp_shard × dp_replicate); returns the three, None where fewer than two were given
    (the one given stays, the others follow from the world size). A contradiction, a size
    below 1 or a factor that does not divide dp is one ValueError line naming all of them by
    ``names`` (the flags' spellings on a command line)."""
    given = dict(zip(names, (dp, dp_shard, dp_replicate), strict=True))
    for name, value in given.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    n_dp, n_s, n_r = names
    if dp is None:
        return (
            (dp_shard * dp_replicate if dp_shard and dp_replicate else None),
            dp_shard,
            dp_replicate,
        )
    if dp_shard is not None and dp_replicate is not None:
        if dp_shard * dp_replicate != dp:
            raise ValueError(
                f"{n_dp} {dp}, {n_s} {dp_shard} and {n_r} {dp_replicate} disagree: {n_dp} must "
                f"be {n_s} x {n_r} = {dp_shard * dp_replicate}; give any two of the three and "
                f"the third follows"
            )
        return dp, dp_shard, dp_replicate
    for name, value in ((n_s, dp_shard), (n_r, dp_replicate)):
        if value is not None and dp % value:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ValueError(
                f"{name} {value} does not divide {n_dp} {dp}; {name} must be one of {divisors} "
                f"({n_dp} = {n_s} x {n_r})"
            )
    if dp_shard is not None:
        return dp, dp_shard, dp // dp_shard
    if dp_replicate is not None:
        return dp, dp // dp_replicate, dp_replicate
    return dp, None, None


@dataclass(frozen=True)
class MeshLayout:
    """A checked parallel layout of ``world_size`` ranks.

    Attributes:
        world_size: number of ranks in the job.
        tp: tensor-parallel size (also the expert tensor-parallel size).
        pp: pipeline-parallel size (number of stages).
        ep: expert-parallel size; must divide dp × cp.
        order: axis order, first fastest; each of tp/ep/dp/pp once, cp at most once.
        cp: context-parallel size (ranks holding chunks of one sequence).
        dp_shard: hybrid sharding: the ranks of dp that shard one copy of the weights (None:
            dp / dp_replicate, i.e. all of dp: full sharding).
        dp_replicate: hybrid sharding: the copies (None: dp / dp_shard); dp_shard ×
            dp_replicate = dp. Both are set to the resolved sizes.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    cp: int = 1
    dp_shard: int | None = None
    dp_replicate: int | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep", "cp", "dp_shard", "dp_replicate"):
            value = getattr(self, name)
            if value is None and name.startswith("dp_"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        tokens = parse_order(self.order)
        # the order names cp only with context parallelism: "tp-ep-dp-pp" is the same layout
        keep = tokens if self.cp > 1 else tuple(t for t in tokens if t != "cp")
        object.__setattr__(self, "order", "-".join(keep))
        if self.cp > 1 and self.world_size % (self.tp * self.cp * self.pp):
            raise ValueError(
                f"world_size {self.world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {self.tp * self.cp * self.pp}; use a world "
                f"size that is a multiple of {self.tp * self.cp * self.pp}"
            )
        if self.world_size % (self.tp * self.pp):
            works = [
                d for d in range(1, self.world_size + 1) if self.world_size % (d * self.tp) == 0
            ]
            fits = f"pp must be one of {works}, or use" if works else "use"
            raise ValueError(
                f"world_size {self.world_size} is not divisible by tp*pp = {self.tp}*{self.pp} "
                f"= {self.tp * self.pp}; with tp={self.tp}, {fits} a world size that is a "
                f"multiple of {self.tp * self.pp}"
            )
        dp = self.world_size // (self.tp * self.cp * self.pp)
        if (dp * self.cp) % self.ep:
            n = dp * self.cp
            divisors = [e for e in range(1, n + 1) if n % e == 0]
            if self.cp == 1:
                what = f"(= world_size {self.world_size} / (tp*pp = {self.tp * self.pp}))"
                fix = "(expert-dp = dp / ep)"
            else:
                what = (
                    f"(= world_size {self.world_size} / (tp*cp*pp = "
                    f"{self.tp * self.cp * self.pp})) times cp {self.cp}"
                )
                fix = "(expert-dp = dp·cp / ep)"
            raise ValueError(
                f"data-parallel size {dp} {what} is not divisible by ep {self.ep}; ep must be "
                f"one of {divisors} {fix}"
            )
        self._resolve_hybrid(dp)
        self._check_grids_agree(tokens)
        edpr, dpr = self.groups["expert-dp-replicate"], self.groups["dp-replicate"]
        if self.ep > 1 and self.hybrid and sorted(edpr) != sorted(dpr):
            raise ValueError(
                f"order {self.order!r} gives the experts other replicate groups ({edpr[:2]} ...) "
                f"than the dense weights ({dpr[:2]} ...) under hybrid sharding; put 'ep' right "
                f"before 'dp', e.g. {DEFAULT_ORDER!r}"
            )

    def _resolve_hybrid(self, dp: int) -> None:
        """Set dp_shard and dp_replicate (S × R = dp), or refuse them naming the fix."""
        s, r = self.dp_shard, self.dp_replicate
        what = (
            f"dp = {dp} (world_size {self.world_size} / (tp*cp*pp = {self.tp}*{self.cp}*{self.pp}))"
        )
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        if s is None and r is None:
            s, r = dp, 1
        elif r is None or s is None:
            given, name, other = (s, "dp_shard", "dp_replicate")
            if s is None:
                given, name, other = (r, "dp_replicate", "dp_shard")
            if dp % given:
                raise ValueError(
                    f"{name} {given} does not divide {what}; {name} must be one of {divisors} "
                    f"({other} = dp / {name})"
                )
            s, r = (given, dp // given) if name == "dp_shard" else (dp // given, given)
        elif s * r != dp:
            raise ValueError(
                f"dp_shard {s} x dp_replicate {r} = {s * r} is not {what}; choose them with "
                f"dp_shard * dp_replicate = {dp}, e.g. dp_shard={dp // r if dp % r == 0 else dp}"
                f" dp_replicate={r if dp % r == 0 else 1}, or give one and let the other follow"
            )
        if r > 1 and (s * self.cp) % self.ep:
            n = s * self.cp
            raise ValueError(
                f"hybrid sharding with ep {self.ep} needs ep to divide dp_shard*cp = {s}*"
                f"{self.cp} = {n} (each shard group holds whole expert-parallel groups); ep "
                f"must be one of {[e for e in range(1, n + 1) if n % e == 0]}, or dp_shard "
                f"a multiple of {self.ep}"
            )
        object.__setattr__(self, "dp_shard", s)
        object.__setattr__(self, "dp_replicate", r)

    def _check_grids_agree(self, tokens: tuple[str, ...]) -> None:
        """Refuse an order whose expert grid does not line up with the dense grid.

        (a) and (b) are Megatron-Core's rules: 'pp' last, pp = 1 or equal data-parallel sizes;
        equal pipeline groups. (c) is fastpar's: equal tp groups, since the MoE layers split
        experts over the dense tp group. With cp = 1, where 'cp' sits in the order is moot.
        """
        dense, expert = self.dense_sizes, self.expert_sizes
        shape = f"tp={self.tp} cp={self.cp} ep={self.ep} dp={self.dp} pp={self.pp}"
        fix = f"put 'pp' last, e.g. {DEFAULT_ORDER!r}"
        dense_pp, expert_pp = grid_groups(dense, tokens, "pp"), grid_groups(expert, tokens, "pp")
        stages = _pipeline_mismatch(dense_pp, expert_pp) if dense_pp != expert_pp else ""
        if self.pp > 1 and not self.order.endswith("pp") and self.expert_dp != self.dp:
            why = f", and {stages}" if stages else ""
            raise ValueError(
                f"order {self.order!r} with {shape} does not end with 'pp' while pp > 1 and "
                f"the expert grid's data-parallel size dp*cp/ep = {self.dp}*{self.cp}/{self.ep} = "
                f"{self.expert_dp} differs from the dense grid's dp = {self.dp}{why}; "
                f"Megatron-Core forbids this (rule: 'pp' last, pp = 1, or equal data-parallel "
                f"sizes); {fix}"
            )
        if stages:
            raise ValueError(
                f"order {self.order!r} with {shape} gives the expert grid other pipeline groups "
                f"than the dense grid: {stages}; Megatron-Core forbids this (rule: equal "
                f"pipeline groups); {fix}"
            )
        dense_tp, expert_tp = grid_groups(dense, tokens, "tp"), grid_groups(expert, tokens, "tp")
        if dense_tp != expert_tp:
            dense_of = {r: g for g in dense_tp for r in g}
            expert_of = {r: g for g in expert_tp for r in g}
            r = next(r for r in sorted(dense_of) if dense_of[r] != expert_of[r])
            raise ValueError(
                f"order {self.order!r} with {shape} gives rank {r} the tp group {dense_of[r]} in "
                f"the dense grid but {expert_of[r]} in the expert grid; fastpar's rule (not "
                f"Megatron-Core's): its MoE layers split experts over the dense tp group, so "
                f"expert shards would land on the wrong ranks; put 'tp' first, e.g. "
                f"{DEFAULT_ORDER!r}"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: world_size / (tp * cp * pp)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def hybrid(self) -> bool:
        """Whether dp_replicate > 1: hybrid sharding (shard inside a group, replicate across)."""
        return self.dp_replicate > 1

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: dp * cp / ep."""
        return self.dp * self.cp // self.ep

    @property
    def dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    @property
    def expert_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}

    @cached_property
    def groups(self) -> dict[str, list[list[int]]]:
        """Every group kind of ``GROUP_KINDS`` → its list of groups (each a list of ranks)."""
        tokens = parse_order(self.order)

        def dense(axes: str) -> list[list[int]]:
            return grid_groups(self.dense_sizes, tokens, axes)

        def expert(axes: str) -> list[list[int]]:
            return grid_groups(self.expert_sizes, tokens, axes)

        pp_groups = dense("pp")
        hybrid = self._hybrid_groups(tokens)
        return {
            "tp": dense("tp"),
            "pp": pp_groups,
            "dp": dense("dp"),
            "mp": dense("tp-pp"),
            "tp-dp": dense("tp-dp"),
            "cp": dense("cp"),
            "dp-cp": dense("cp-dp"),
            "dp-shard": hybrid["dps"],
            "dp-replicate": hybrid["dpr"],
            "dp-shard-cp": hybrid["cp-dps"],
            "tp-cp": dense("tp-cp"),
            "embedding": [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups],
            "ep": expert("ep"),
            "expert-dp": expert("dp"),
            "expert-dp-shard": hybrid["edps"],
            "expert-dp-replicate": hybrid["edpr"],
            "tp-ep": expert("tp-ep"),
        }

    def _hybrid_groups(self, tokens: tuple[str, ...]) -> dict[str, list[list[int]]]:
        """The hybrid-sharding groups: each grid's dp axis split into "dps" (dp_shard; expert
        grid dp_shard·cp/ep) then "dpr" (dp_replicate), the shard part the faster."""
        split = tuple(t for d in tokens for t in (("dps", "dpr") if d == "dp" else (d,)))

        def grid(sizes: dict[str, int], shard: int, axes: str) -> list[list[int]]:
            sizes = {**sizes, "dps": shard, "dpr": self.dp_replicate}
            return grid_groups(sizes, split, axes)

        dense, expert = self.dense_sizes, self.expert_sizes
        edp_shard = self.expert_dp // self.dp_replicate
        return {
            "dps": grid(dense, self.dp_shard, "dps"),
            "dpr": grid(dense, self.dp_shard, "dpr"),
            "cp-dps": grid(dense, self.dp_shard, "cp-dps"),
            "edps": grid(expert, edp_shard, "dps"),
            "edpr": grid(expert, edp_shard, "dpr"),
        }

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that holds ``rank`` (for "embedding": [] if rank is in none)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world [0, {self.world_size})")
        if kind not in GROUP_KINDS:
            raise KeyError(f"unknown group kind {kind!r}; kinds are {list(GROUP_KINDS)}")
        for g in self.groups[kind]:
            if rank in g:
                return g
        return []

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position along each axis: its index inside its tp/pp/dp/ep/expert-dp group."""
        kinds = ("tp", "pp", "dp", "cp", "ep", "expert-dp", "dp-shard", "dp-replicate")
        return {kind: self.group_of(kind, rank).index(rank) for kind in kinds}

    def rank_at(self, *, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0) -> int:
        """The rank with these dense-grid coordinates (inverse of ``coords``)."""
        sizes = self.dense_sizes
        rank, stride = 0, 1
        for d in parse_order(self.order):
            c = {"tp": tp, "pp": pp, "dp": dp, "ep": 0, "cp": cp}[d]
            if not 0 <= c < sizes[d]:
                raise ValueError(f"{d} coordinate {c} is outside [0, {sizes[d]})")
            rank += c * stride
            stride *= sizes[d]
        return rank

    def describe(self) -> str:
        """A readable text table: sizes, each rank's coordinates, then every group."""
        lines = [
            f"world_size={self.world_size}  tp={self.tp}  cp={self.cp}  pp={self.pp}  "
            f"dp={self.dp}  ep={self.ep}  expert-dp={self.expert_dp}  order={self.order}"
            + (
                f"  dp-shard={self.dp_shard}  dp-replicate={self.dp_replicate}"
                if self.hybrid
                else ""
            ),
            "",
            f"{'rank':>4}  {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>3} {'ep':>3} {'edp':>3}  "
            + (f"{'dps':>3} {'dpr':>3}  " if self.hybrid else "")
            + "stage",
        ]
        for r in range(self.world_size):
            c = self.coords(r)
            stage = "first" if c["pp"] == 0 else ""
            if c["pp"] == self.pp - 1:
                stage = "first+last" if self.pp == 1 else "last"
            hybrid = f"{c['dp-shard']:>3} {c['dp-replicate']:>3}  " if self.hybrid else ""
            lines.append(
                f"{r:>4}  {c['tp']:>3} {c['cp']:>3} {c['pp']:>3} {c['dp']:>3} {c['ep']:>3} "
                f"{c['expert-dp']:>3}  {hybrid}{stage}"
            )
        for kind, what in GROUP_KINDS.items():
            groups = self.groups[kind]
            lines += ["", f"{kind} ({len(groups)} groups) — {what}"]
            lines += [
                "  " + " ".join(str(g) for g in groups[i : i + 8]) for i in range(0, len(groups), 8)
            ]
        return "\n".join(lines)


def rank_groups(
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    order: str = DEFAULT_ORDER,
    cp: int = 1,
    dp_shard: int | None = None,
    dp_replicate: int | None = None,
) -> dict[str, list[list[int]]]:
    """Every parallel group of a layout, as lists of global ranks.

    Keys: those of ``GROUP_KINDS``. dp = world_size / (tp * cp * pp) = dp_shard * dp_replicate;
    expert-dp = dp * cp / ep. Raises ValueError for an impossible layout, naming the numbers
    and what would work.

    >>> g = rank_groups(16, tp=2, pp=4)
    >>> g["dp"][:3], g["pp"][0]
    ([[0, 2], [1, 3], [4, 6]], [0, 4, 8, 12])
    """
    layout = MeshLayout(
        world_size,
        tp=tp,
        pp=pp,
        ep=ep,
        order=order,
        cp=cp,
        dp_shard=dp_shard,
        dp_replicate=dp_replicate,
    )
    return {k: [list(g) for g in v] for k, v in layout.groups.items()}
