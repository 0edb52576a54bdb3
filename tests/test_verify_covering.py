"""The covering-array generator of the verification matrix (``_covering``), on small tables
whose answers can be enumerated: every pair some valid row holds is covered, no row the
oracle refuses is emitted, pairs no valid row holds are excluded with the oracle's reason,
the same table gives the same rows, and the rows stay close to the lower bound."""

from __future__ import annotations

from itertools import product

import pytest
from _covering import Factor, all_pairs, covering, row_pairs


def _every_row(factors):
    for values in product(*(f.levels for f in factors)):
        yield {f.name: v for f, v in zip(factors, values, strict=True)}


def _possible_pairs(factors, refusal) -> set:
    """The pairs some valid row holds, by enumerating every row."""
    return {
        p for row in _every_row(factors) if refusal(row) is None for p in row_pairs(factors, row)
    }


def _accept(row) -> None:
    return None


TABLE = [
    Factor("a", ("a0", "a1", "a2")),
    Factor("b", ("b0", "b1", "b2")),
    Factor("c", ("c0", "c1")),
    Factor("d", ("d0", "d1", "d2", "d3")),
    Factor("e", ("e0", "e1")),
]


def _constrained(row) -> str | None:
    """a1 never with b1 (a pair); d3 only with c1 and e1 both (a level that needs two others);
    a2 with b2 only when c0 (a triple: both pairs still possible)."""
    if row["a"] == "a1" and row["b"] == "b1":
        return "a1 refuses b1"
    if row["d"] == "d3" and not (row["c"] == "c1" and row["e"] == "e1"):
        return "d3 needs c1 and e1"
    if row["a"] == "a2" and row["b"] == "b2" and row["c"] != "c0":
        return "a2 with b2 needs c0"
    return None


@pytest.mark.parametrize("refusal", [_accept, _constrained], ids=["free", "constrained"])
def test_every_possible_pair_is_covered_by_valid_rows(refusal):
    cov = covering(TABLE, refusal)
    possible = _possible_pairs(TABLE, refusal)
    held = {p for row in cov.rows for p in row_pairs(TABLE, row)}
    assert possible <= held and not cov.missing()
    assert all(refusal(row) is None for row in cov.rows)  # no invalid case emitted
    assert set(cov.required) == possible  # exactly the impossible pairs are excluded
    assert set(cov.excluded) == set(all_pairs(TABLE)) - possible
    assert all(cov.rows[cov.covered[p]] for p in cov.required)  # (each names a row holding it)
    for p, i in cov.covered.items():
        assert p in row_pairs(TABLE, cov.rows[i])


def test_excluded_pairs_carry_the_oracles_reason():
    cov = covering(TABLE, _constrained)
    d3 = "d3 needs c1 and e1"
    assert cov.excluded == {
        (("a", "a1"), ("b", "b1")): "a1 refuses b1",
        (("c", "c0"), ("d", "d3")): d3,
        (("d", "d3"), ("e", "e0")): d3,
    }
    # d3 needs two other factors changed from their safe levels: found within max_changes 2
    assert (("c", "c1"), ("d", "d3")) in cov.covered
    # ... but not with one change: then its pairs are (wrongly) excluded, and say why
    narrow = covering(TABLE, _constrained, max_changes=1)
    assert narrow.excluded[(("a", "a0"), ("d", "d3"))] == d3


def test_a_safe_level_lets_partial_rows_complete():
    """Completing from a level that refuses everything else would exclude every pair of it;
    the factor's safe level is tried first."""

    def only_x1(row):
        return None if row["x"] == "x1" or row["y"] == "y0" else "y1 and y2 need x1"

    factors = [Factor("x", ("x0", "x1"), safe="x1"), Factor("y", ("y0", "y1", "y2"))]
    factors += [Factor("z", ("z0", "z1"))]
    cov = covering(factors, only_x1, max_changes=0)
    assert set(cov.excluded) == {(("x", "x0"), ("y", "y1")), (("x", "x0"), ("y", "y2"))}
    assert not cov.missing()


def test_seeds_are_held_completed_and_kept():
    seeds = [{"a": "a2", "b": "b2"}, {"d": "d3"}]
    cov = covering(TABLE, _constrained, seeds=seeds)
    assert all(_constrained(row) is None for row in cov.rows) and not cov.missing()
    for seed in seeds:
        assert any(all(row[k] == v for k, v in seed.items()) for row in cov.rows)
    assert cov.rows[0]["c"] == "c0"  # a2 with b2 needs c0: the seed was completed validly
    with pytest.raises(ValueError, match="no valid row holds it"):  # (an excluded pair)
        covering(TABLE, _constrained, seeds=[{"a": "a1", "b": "b1"}])


def test_the_same_table_gives_the_same_rows():
    first = covering(TABLE, _constrained)
    again = covering(list(TABLE), _constrained)
    assert first.rows == again.rows and first.excluded == again.excluded


def test_rows_stay_near_the_lower_bound():
    """Three 2-level factors: 4 rows (the optimum); the larger free table: within 50 % of the
    bound (the most pairs between two factors, 4 x 3 = 12)."""
    small = [Factor(n, (f"{n}0", f"{n}1")) for n in "pqr"]
    assert len(covering(small, _accept).rows) == 4
    cov = covering(TABLE, _accept)
    assert cov.lower_bound() == 12
    assert cov.lower_bound() <= len(cov.rows) <= 18


def test_a_dropped_row_leaves_pairs_missing():
    """The coverage check can fail: without a row, some pair it alone held is missing."""
    cov = covering(TABLE, _constrained)
    others = {p for row in cov.rows[1:] for p in row_pairs(TABLE, row)}
    alone = set(row_pairs(TABLE, cov.rows[0])) - others
    cov.rows = cov.rows[1:]
    assert alone and alone == set(cov.missing())  # (redundant rows were dropped)


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="levels must be distinct"):
        Factor("a", ("x", "x"))
    with pytest.raises(ValueError, match="safe level 'z' is not a level"):
        Factor("a", ("x", "y"), safe="z")
    with pytest.raises(ValueError, match="factor names must be distinct"):
        covering([Factor("a", ("x",)), Factor("a", ("y",))], _accept)
