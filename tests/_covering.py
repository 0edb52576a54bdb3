"""Covering arrays of strength 2 under constraints: few rows that together hold every pair of
levels of two factors that some valid row can hold.

The constraints are an oracle, ``refusal(row) -> str | None`` (the reason a whole row is
invalid, or None), not a list of forbidden pairs: a pair no valid row holds is found by search
and excluded from what must be covered, with the oracle's reason. The search completes a
partial row from each free factor's ``safe`` level (the most permissive one), then from rows
that differ from it in one free factor, then in two (``max_changes``); a pair it cannot
complete that way is excluded, with the refusal its nearest completions got (``reason``; the
exclusions are printed, and a test pins them).

The rows are built greedily, as AETG does (Cohen et al., 1997), deterministically: each row
starts from the uncovered pair whose two levels have the most uncovered pairs left, then takes
the other factors (those with the most uncovered pairs first) one by one, each at the level
that covers the most new pairs with the levels already chosen and can still be completed to a
valid row. A row holds at least its first pair, so the loop ends; then rows whose every pair
another row holds are dropped. Pure Python: no randomness, the same table gives the same rows.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations, product

Row = dict[str, str]
Level = tuple[str, str]  # (factor, level)
Pair = tuple[Level, Level]  # the first factor comes first in the table


@dataclass(frozen=True)
class Factor:
    """A factor: its name, its levels, and the level partial rows are completed with first."""

    name: str
    levels: tuple[str, ...]
    safe: str = ""

    def __post_init__(self) -> None:
        if not self.levels or len(set(self.levels)) != len(self.levels):
            raise ValueError(f"factor {self.name}: levels must be distinct, got {self.levels}")
        if not self.safe:
            object.__setattr__(self, "safe", self.levels[0])
        if self.safe not in self.levels:
            raise ValueError(f"factor {self.name}: safe level {self.safe!r} is not a level")


@dataclass
class Coverage:
    """The rows; every pair of the table (``pairs``); the pairs no valid row holds, each with
    the refusal its nearest completions got (``excluded``); the first row holding each other pair
    (``covered``); how many rows the oracle judged (``checks``)."""

    factors: list[Factor]
    rows: list[Row]
    pairs: list[Pair]
    excluded: dict[Pair, str] = field(default_factory=dict)
    covered: dict[Pair, int] = field(default_factory=dict)
    checks: int = 0

    @property
    def required(self) -> list[Pair]:
        return [p for p in self.pairs if p not in self.excluded]

    def missing(self) -> list[Pair]:
        """Required pairs that no row holds (empty for a complete covering array)."""
        held = {p for row in self.rows for p in row_pairs(self.factors, row)}
        return [p for p in self.required if p not in held]

    def lower_bound(self) -> int:
        """No covering array of these required pairs has fewer rows: the most required pairs
        between two factors (each row holds one of them)."""
        per = Counter((a[0], b[0]) for a, b in self.required)
        return max(per.values(), default=0)


def all_pairs(factors: Sequence[Factor]) -> list[Pair]:
    return [
        ((f.name, a), (g.name, b))
        for f, g in combinations(factors, 2)
        for a in f.levels
        for b in g.levels
    ]


def row_pairs(factors: Sequence[Factor], row: Row) -> list[Pair]:
    return [((f.name, row[f.name]), (g.name, row[g.name])) for f, g in combinations(factors, 2)]


class Search:
    """The oracle, remembered per row, and the completion of partial rows."""

    def __init__(self, factors: Sequence[Factor], refusal: Callable[[Row], str | None], changes):
        self.factors, self.refusal, self.changes = list(factors), refusal, changes
        self.memo: dict[tuple, str | None] = {}

    def refused(self, row: Row) -> str | None:
        key = tuple(row[f.name] for f in self.factors)
        if key not in self.memo:
            self.memo[key] = self.refusal(dict(row))
        return self.memo[key]

    def candidates(self, fixed: Row, changes: int | None = None) -> Iterator[Row]:
        """Completions of ``fixed``: the safe one, then those differing from it in one free
        factor, then in two, ... up to ``changes`` (default ``self.changes``); in table order."""
        free = [f for f in self.factors if f.name not in fixed]
        base = {**{f.name: f.safe for f in free}, **fixed}
        most = self.changes if changes is None else changes
        for n in range(min(most, len(free)) + 1):
            for chosen in combinations(free, n):
                others = [[v for v in f.levels if v != f.safe] for f in chosen]
                for values in product(*others):
                    yield {**base, **{f.name: v for f, v in zip(chosen, values, strict=True)}}

    def complete(self, fixed: Row, accept: Callable[[Row], bool] | None = None) -> Row | None:
        """A valid row holding ``fixed`` (and that ``accept`` takes), or None when the search
        finds none."""
        for row in self.candidates(fixed):
            if self.refused(row) is None and (accept is None or accept(row)):
                return {f.name: row[f.name] for f in self.factors}
        return None

    def reason(self, fixed: Row) -> str:
        """Why no completion of ``fixed`` is valid: the refusal most of its completions with at
        most one change got (the first such on a tie), not counting what a level of ``fixed``
        gets alone (the other factors safe: a level that needs another to mean anything)
        unless no other refusal is left."""
        reasons = Counter(self.refused(row) for row in self.candidates(fixed, changes=1))
        safe = {f.name: f.safe for f in self.factors}
        alone = {
            self.refused({**safe, name: level})
            for name, level in fixed.items()
            if any(safe[g] != w for g, w in fixed.items() if g != name)  # (not the pair's own)
        }
        own = Counter({r: n for r, n in reasons.items() if r not in alone}) or reasons
        return str(own.most_common(1)[0][0])


def covering(
    factors: Sequence[Factor],
    refusal: Callable[[Row], str | None],
    *,
    max_changes: int = 2,
    shared: Sequence[str] = (),
    same: Callable[[Row, Row], bool] | None = None,
    min_gain: int = 1,
    seeds: Sequence[Row] = (),
) -> Coverage:
    """A strength-2 covering array of ``factors`` whose every row ``refusal`` accepts.

    ``shared``: factors whose levels rows share in groups (what an expensive per-row
    computation depends on: with them equal, rows can share it): after a group's first row,
    the next rows keep its levels of ``shared`` (and are ``same(row, first)``) while each still
    covers at least ``min_gain`` new pairs; then a new group starts. ``seeds``: partial rows
    the array must hold (each completed greedily, first, and never dropped)."""
    factors = list(factors)
    names = [f.name for f in factors]
    if len(set(names)) != len(names):
        raise ValueError(f"factor names must be distinct, got {names}")
    if not set(shared) <= set(names):
        raise ValueError(f"shared factors {sorted(set(shared) - set(names))} are not factors")
    search = Search(factors, refusal, max_changes)
    pairs = all_pairs(factors)
    cov = Coverage(factors, [], pairs)
    for pair in pairs:
        if search.complete(dict(pair)) is None:
            cov.excluded[pair] = search.reason(dict(pair))
    grow = _Rows(search, pairs, set(cov.required))
    kept = set()

    def group(first: Row) -> None:  # the first row, then the rows sharing its references
        cov.rows.append(grow.take(first))
        base = {n: first[n] for n in shared}
        accept = None if same is None else functools.partial(_same_as, same, first)
        while shared and grow.uncovered:
            row = grow.next(base, accept)
            if row is None or grow.gain(row) < min_gain:
                break
            cov.rows.append(grow.take(row))

    for seed in seeds:
        first = grow.next(dict(seed), None) or search.complete(dict(seed))  # (no new pair left)
        if first is None:
            raise ValueError(f"seed {dict(seed)}: no valid row holds it")
        kept.add(len(cov.rows))
        group(first)
    while grow.uncovered:
        first = grow.next({}, None)
        if first is None:  # every required pair has a completion: a seed always has one
            raise AssertionError(f"no row covers any of {sorted(grow.uncovered)[:3]}")
        group(first)
    cov.rows = _drop_redundant(factors, cov.rows, kept)
    for i, row in enumerate(cov.rows):
        for p in row_pairs(factors, row):
            cov.covered.setdefault(p, i)
    cov.checks = len(search.memo)
    return cov


def _same_as(same: Callable[[Row, Row], bool], first: Row, row: Row) -> bool:
    return same(row, first)


class _Rows:
    """The greedy rows over the pairs still ``uncovered``."""

    def __init__(self, search: Search, pairs: list[Pair], uncovered: set[Pair]) -> None:
        self.search, self.factors, self.uncovered = search, search.factors, uncovered
        self.order = {p: i for i, p in enumerate(pairs)}
        self.index = {f.name: i for i, f in enumerate(self.factors)}

    def gain(self, row: Row) -> int:
        return sum(p in self.uncovered for p in row_pairs(self.factors, row))

    def take(self, row: Row) -> Row:
        self.uncovered -= set(row_pairs(self.factors, row))
        return row

    def next(self, base: Row, accept: Callable[[Row], bool] | None) -> Row | None:
        """The next row holding ``base`` (and that ``accept`` takes), or None: it starts from
        the uncovered pair (agreeing with ``base``) whose two levels have the most uncovered
        pairs left and that can be completed, then takes the other factors, those with the
        most uncovered pairs first, each at the level that covers the most new pairs with the
        levels chosen so far and can still be completed."""
        search, left = self.search, Counter(level for p in self.uncovered for level in p)
        seeds = [p for p in self.uncovered if all(base.get(f, v) == v for f, v in p)]
        seeds.sort(key=lambda p: (-(left[p[0]] + left[p[1]]), self.order[p]))
        row = next((r for p in seeds if search.complete(r := {**base, **dict(p)}, accept)), None)
        if row is None:
            return None
        free = [f for f in self.factors if f.name not in row]
        free.sort(key=lambda f: -sum(left[(f.name, v)] for v in f.levels))  # (stable)
        for f in free:
            gains = {v: -_gain(self.index, self.uncovered, row, (f.name, v)) for v in f.levels}
            for v in sorted(f.levels, key=gains.__getitem__):  # (stable: table order on ties)
                if search.complete({**row, f.name: v}, accept) is not None:
                    row[f.name] = v
                    break
            else:  # the row so far had a completion: one of its levels is possible
                raise AssertionError(f"no level of {f.name} completes {row}")
        row = {f.name: row[f.name] for f in self.factors}
        if search.refused(row) is not None or (accept is not None and not accept(row)):
            raise AssertionError(f"row {row} refused: {search.refused(row)}")
        return row


def _gain(index: dict[str, int], uncovered: set[Pair], row: Row, mine: Level) -> int:
    """How many uncovered pairs ``mine`` makes with the levels chosen in ``row``."""
    return sum(
        ((g, w), mine) in uncovered if index[g] < index[mine[0]] else (mine, (g, w)) in uncovered
        for g, w in row.items()
    )


def _drop_redundant(factors: Sequence[Factor], rows: list[Row], kept=frozenset()) -> list[Row]:
    """Without the rows (last first; not those ``kept``) whose every pair another kept row
    holds."""
    counts = Counter(p for row in rows for p in row_pairs(factors, row))
    dropped = set()
    for i in reversed(range(len(rows))):
        mine = row_pairs(factors, rows[i])
        if i not in kept and all(counts[p] > 1 for p in mine):
            dropped.add(i)
            counts.subtract(mine)
    return [row for i, row in enumerate(rows) if i not in dropped]
