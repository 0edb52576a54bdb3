"""The pure rank layout against Megatron-Core's published layouts and two independent oracles."""

from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest

from fastpar.mesh import GROUP_KINDS, MeshLayout, rank_groups

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "ep", "dp", "pp"))]
CP_ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "ep", "dp", "pp"))]


def _tokens(order, cp=1):
    tokens = order.split("-")
    if "cp" not in tokens:  # Megatron's place for it: right after tp
        tokens.insert(tokens.index("tp") + 1, "cp")
    return tokens


def _np_groups(world, tokens, sizes, axes):
    """Groups spanned by ``axes`` by reshaping an arange, independent of fastpar's strides.

    The grid arange(world).reshape(sizes of the order, reversed) puts the first axis of the
    order last, i.e. fastest. A group spanning some axes: move the other axes to the front
    (later axes first so the earliest varies fastest), then flatten each group's block.
    """
    rev = list(reversed(tokens))
    grid = np.arange(world).reshape([sizes[t] for t in rev])
    span = axes.split("-")
    outside = [rev.index(t) for t in rev if t not in span]
    inside = [rev.index(t) for t in rev if t in span]
    size = int(np.prod([sizes[t] for t in span]))
    return grid.transpose(outside + inside).reshape(-1, size).tolist()


def _np_sizes(world, tp, pp, ep, cp=1):
    dp = world // (tp * cp * pp)
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert = {"tp": tp, "cp": 1, "ep": ep, "dp": dp * cp // ep, "pp": pp}
    return dense, expert


def numpy_oracle(world, tp, pp, ep, order, cp=1):
    """Every group kind of a layout, built with ``_np_groups`` on the dense and expert grids."""
    tokens = _tokens(order, cp)
    dense, expert = _np_sizes(world, tp, pp, ep, cp)

    def groups(sizes, axes):
        return _np_groups(world, tokens, sizes, axes)

    out = {k: groups(dense, k) for k in ("tp", "pp", "dp", "cp")}
    out["mp"] = groups(dense, "tp-pp")
    out["tp-dp"] = groups(dense, "tp-dp")
    out["dp-cp"] = groups(dense, "cp-dp")
    out["tp-cp"] = groups(dense, "tp-cp")
    out["embedding"] = [[g[0], g[-1]] if pp > 1 else [g[0]] for g in out["pp"]]
    out["ep"] = groups(expert, "ep")
    out["expert-dp"] = groups(expert, "dp")
    out["tp-ep"] = groups(expert, "tp-ep")
    # full sharding (no dp_shard): the shard groups are dp's, the replicas single ranks
    out["dp-shard"], out["dp-shard-cp"] = out["dp"], out["dp-cp"]
    out["expert-dp-shard"] = out["expert-dp"]
    out["dp-replicate"] = out["expert-dp-replicate"] = [[r] for r in range(world)]
    return out


def broken_rules(world, tp, pp, ep, order, cp=1):
    """Which of the grid rules a layout breaks, computed with numpy.

    "a" (Megatron-Core): the order ends with pp (cp left out when cp = 1), or pp = 1, or the
    expert grid's dp·cp/ep equals the dense dp; "b" (Megatron-Core): both grids have the same
    pp groups; "c" (fastpar): both grids have the same tp groups.
    """
    full = _tokens(order, cp)
    named = [t for t in full if cp > 1 or t != "cp"]
    dense, expert = _np_sizes(world, tp, pp, ep, cp)
    broken = set()
    if not (named[-1] == "pp" or pp == 1 or expert["dp"] == dense["dp"]):
        broken.add("a")
    if _np_groups(world, full, dense, "pp") != _np_groups(world, full, expert, "pp"):
        broken.add("b")
    if _np_groups(world, full, dense, "tp") != _np_groups(world, full, expert, "tp"):
        broken.add("c")
    return broken


def loop_oracle_default_order(world, tp, pp, ep):
    """The pre-RankGenerator way of building Megatron's groups, written as explicit loops.

    Only for the default order tp-(ep)-dp-pp: pipeline stages are contiguous blocks of
    world/pp ranks; inside a stage, tp ranks are consecutive and dp ranks stride by tp.
    """
    dp, per_stage = world // (tp * pp), world // pp
    edp = dp // ep
    tp_g = [list(range(i, i + tp)) for i in range(0, world, tp)]
    pp_g = [list(range(i, world, per_stage)) for i in range(per_stage)]
    dp_g = [
        list(range(s * per_stage + j, (s + 1) * per_stage, tp))
        for s in range(pp)
        for j in range(tp)
    ]
    tp_dp = [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(pp)]
    mp = [[s * per_stage + d * tp + k for s in range(pp) for k in range(tp)] for d in range(dp)]

    # expert grid tp × ep × edp × pp, tp fastest
    def r(k, e, d, s):
        return k + tp * (e + ep * (d + edp * s))

    ep_g = [
        [r(k, e, d, s) for e in range(ep)] for s in range(pp) for d in range(edp) for k in range(tp)
    ]
    edp_g = [
        [r(k, e, d, s) for d in range(edp)] for s in range(pp) for e in range(ep) for k in range(tp)
    ]
    tp_ep = [
        [r(k, e, d, s) for e in range(ep) for k in range(tp)] for s in range(pp) for d in range(edp)
    ]
    emb = [[g[0], g[-1]] if pp > 1 else [g[0]] for g in pp_g]
    return {
        "tp": tp_g,
        "pp": pp_g,
        "dp": dp_g,
        "mp": mp,
        "tp-dp": tp_dp,
        "embedding": emb,
        "ep": ep_g,
        "expert-dp": edp_g,
        "tp-ep": tp_ep,
        "cp": [[r] for r in range(world)],
        "dp-cp": dp_g,
        "tp-cp": tp_g,  # cp = 1
        # full sharding (no dp_shard): the shard groups are dp's, the replicas single ranks
        "dp-shard": dp_g,
        "dp-replicate": [[r] for r in range(world)],
        "dp-shard-cp": dp_g,
        "expert-dp-shard": edp_g,
        "expert-dp-replicate": [[r] for r in range(world)],
    }


def test_megatron_docstring_example():
    g = rank_groups(16, tp=2, pp=4)
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert g["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert set(g) == set(GROUP_KINDS)


def test_expert_groups_by_hand():
    # 8 ranks, tp=2, pp=2 -> dp=2, ep=2 -> expert-dp=1. Stage 0 holds ranks 0-3.
    g = rank_groups(8, tp=2, pp=2, ep=2)
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["expert-dp"] == [[r] for r in range(8)]
    assert g["tp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # 16 ranks, tp=1, pp=2, ep=2 -> dp=8, expert-dp=4
    g = rank_groups(16, pp=2, ep=2)
    assert g["ep"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert g["expert-dp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["tp-ep"][0] == [0, 1]


def test_context_parallel_groups_by_hand():
    """Megatron-Core's RankGenerator with cp (order tp-cp-ep-dp-pp): cp ranks stride by tp, dp
    ranks by tp·cp; the expert grid folds cp into its data axis, so EP spans cp ranks."""
    g = rank_groups(8, tp=2, cp=2)
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    g = rank_groups(8, tp=2, cp=2, ep=2)
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = rank_groups(16, tp=2, cp=2, pp=2)
    assert g["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g["cp"][:2] == [[0, 2], [1, 3]] and g["dp"][:2] == [[0, 4], [1, 5]]
    assert MeshLayout(8, cp=2).order == "tp-cp-ep-dp-pp"
    assert MeshLayout(8).order == "tp-ep-dp-pp"  # cp = 1: the same layout, cp not named


def test_pp1_embedding_is_first_rank_only():
    g = rank_groups(4, tp=2)
    assert g["embedding"] == [[0], [1], [2], [3]]
    assert g["pp"] == [[0], [1], [2], [3]]


# Megatron-Core's own layout test matrix (nodes × 8 GPUs, cp = 1) for tp, pp, ep.
MEGATRON_CASES = [
    (1, 1, 1, 1),
    (8, 8, 1, 1),
    (8, 2, 2, 1),
    (8, 2, 4, 1),
    (24, 8, 3, 1),
    (32, 2, 4, 1),
    (64, 8, 8, 1),
    (64, 2, 1, 4),
    (128, 4, 8, 1),
    (128, 4, 8, 4),
    (256, 4, 8, 4),
    (512, 4, 2, 8),
    (768, 4, 8, 1),
]


@pytest.mark.parametrize("world,tp,pp,ep", MEGATRON_CASES)
def test_default_order_matches_loop_oracle(world, tp, pp, ep):
    assert rank_groups(world, tp=tp, pp=pp, ep=ep) == loop_oracle_default_order(world, tp, pp, ep)


def _random_layouts(n, seed=1234):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        tp, pp, ep = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4])
        cp = rng.choice([1, 1, 2, 3])
        edp = rng.choice([1, 2, 3])
        order = rng.choice(CP_ORDERS if cp > 1 else ORDERS)
        world = tp * pp * ep * edp  # = tp * cp * dp * pp with dp * cp = ep * edp
        if (ep * edp) % cp or world > 192 or broken_rules(world, tp, pp, ep, order, cp):
            continue
        out.append((world, tp, pp, ep, order, cp))
    return out


RANDOM_LAYOUTS = _random_layouts(300)


def test_random_layouts_properties():
    checked = 0
    for world, tp, pp, ep, order, cp in RANDOM_LAYOUTS:
        layout = MeshLayout(world, tp=tp, pp=pp, ep=ep, order=order, cp=cp)
        groups = layout.groups
        sizes = {
            "tp": tp,
            "pp": pp,
            "dp": layout.dp,
            "mp": tp * pp,
            "tp-dp": tp * layout.dp,
            "ep": ep,
            "expert-dp": layout.expert_dp,
            "tp-ep": tp * ep,
            "cp": cp,
            "dp-cp": layout.dp * cp,
            "tp-cp": tp * cp,
        }
        want = numpy_oracle(world, tp, pp, ep, order, cp)
        assert groups == want, (world, tp, pp, ep, order, cp)
        for kind, size in sizes.items():
            flat = sorted(r for g in groups[kind] for r in g)
            assert flat == list(range(world)), f"{kind} does not partition {world} ranks"
            assert all(len(g) == size for g in groups[kind]), (kind, size)
        # embedding: one group per pipeline, its ends
        assert len(groups["embedding"]) == len(groups["pp"])
        # coordinates map back to the rank, and agree with the group positions
        for rank in range(world):
            c = layout.coords(rank)
            assert layout.rank_at(tp=c["tp"], pp=c["pp"], dp=c["dp"], cp=c["cp"]) == rank
            assert layout.group_of("tp", rank)[c["tp"]] == rank
        if order.startswith("tp"):
            assert all(g == list(range(g[0], g[0] + tp)) for g in groups["tp"])
        checked += 1
    assert checked == 300


@pytest.mark.parametrize("order", [o for o in ORDERS if o.endswith("pp")])
def test_dense_and_expert_pipelines_agree_when_pp_last(order):
    if broken_rules(24, 2, 3, 2, order):  # tp after ep or dp: the two grids' tp groups differ
        assert order in ("ep-tp-dp-pp", "dp-tp-ep-pp")
        with pytest.raises(ValueError, match=r"fastpar's rule \(not Megatron-Core's\)"):
            MeshLayout(24, tp=2, pp=3, ep=2, order=order)
        return
    layout = MeshLayout(24, tp=2, pp=3, ep=2, order=order)
    exp = numpy_oracle(24, 2, 3, 2, order)
    assert layout.groups["pp"] == exp["pp"]
    # every ep / expert-dp group lies inside one pipeline stage's tp-dp group
    stage_of = {r: i for i, g in enumerate(layout.groups["tp-dp"]) for r in g}
    for kind in ("ep", "expert-dp", "tp-ep"):
        for g in layout.groups[kind]:
            assert len({stage_of[r] for r in g}) == 1, (kind, g)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=12, tp=5), r"world_size 12 is not divisible by tp\*pp = 5\*1"),
        (
            dict(world_size=16, tp=2, pp=3),
            r"not divisible by tp\*pp = 2\*3 = 6.*pp must be one of \[1, 2, 4, 8\]",
        ),
        (
            dict(world_size=16, tp=2, pp=2, ep=3),
            r"data-parallel size 4 .* not divisible by ep 3; ep must be one of \[1, 2, 4\]",
        ),
        (dict(world_size=8, order="tp-cp-dp-pp"), r"missing \['ep'\]"),
        (dict(world_size=8, order="tp-cp-cp-ep-dp-pp"), r"repeats \['cp'\]"),
        (dict(world_size=12, tp=2, cp=4), r"not divisible by tp\*cp\*pp = 2\*4\*1 = 8"),
        (
            dict(world_size=6, cp=3, ep=4),
            r"data-parallel size 2 .* times cp 3 is not divisible by ep 4",
        ),
        (dict(world_size=8, order="tp-xx-dp-pp"), r"unknown token\(s\) \['xx'\]"),
        (dict(world_size=8, order="tp-dp-pp"), r"missing \['ep'\]"),
        (dict(world_size=8, order="tp-dp-dp-pp"), r"repeats \['dp'\]"),
        (
            dict(world_size=8, pp=2, ep=2, order="tp-pp-ep-dp"),
            r"order 'tp-pp-ep-dp' with tp=1 cp=1 ep=2 dp=4 pp=2 does not end with 'pp' while pp > 1 and the expert grid's data-parallel size dp\*cp/ep = 4\*1/2 = 2 differs from the dense grid's dp = 4; Megatron-Core forbids this .*put 'pp' last, e.g. 'tp-cp-ep-dp-pp'$",
        ),
        (
            dict(world_size=4, cp=2, pp=2, order="tp-cp-pp-dp-ep"),
            r"dp\*cp/ep = 1\*2/1 = 2 differs from the dense grid's dp = 1, and rank 1 is in stage 0 of the dense grid but stage 1 of the expert grid.*Megatron-Core forbids",
        ),
        (
            dict(world_size=8, cp=2, pp=2, ep=2, order="tp-cp-pp-dp-ep"),
            r"other pipeline groups than the dense grid: rank 1 is in stage 0 of the dense grid but stage 1 of the expert grid.*Megatron-Core forbids this \(rule: equal pipeline groups\); put 'pp' last",
        ),
        (
            dict(world_size=8, tp=2, cp=2, order="cp-tp-dp-ep-pp"),
            r"gives rank 0 the tp group \[0, 2\] in the dense grid but \[0, 1\] in the expert grid; fastpar's rule \(not Megatron-Core's\).*put 'tp' first",
        ),
        (dict(world_size=0), r"world_size must be a positive integer, got 0"),
        (dict(world_size=8, tp=-2), r"tp must be a positive integer, got -2"),
    ],
)
def test_bad_layouts_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeshLayout(**kwargs)
    with pytest.raises(ValueError, match=match):
        rank_groups(**kwargs)


def test_pp_not_last_is_fine_without_ep():
    # Megatron allows any order when ep = 1 (or pp = 1): dense and expert grids coincide.
    g = rank_groups(8, tp=2, pp=2, order="tp-pp-ep-dp")
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = rank_groups(8, tp=2, ep=2, order="tp-dp-ep-pp")
    assert g["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pp_not_last_with_stages_mixed_is_refused():
    # cp = 2, ep = 1: the expert grid's data axis has size dp·cp = 2 where the dense one has 1,
    # so its pp groups [[0, 1], [2, 3]] are not the dense [[0, 2], [1, 3]]; this used to be
    # accepted with expert-dp [[0, 2], [1, 3]], which mixes stage 0 and stage 1.
    with pytest.raises(ValueError, match=r"rank 1 is in stage 0 of the dense grid but stage 1"):
        rank_groups(4, tp=1, cp=2, pp=2, ep=1, order="tp-cp-pp-dp-ep")
    # ep = cp: equal data-parallel sizes and equal pp groups, so Megatron-Core allows it.
    g = rank_groups(8, cp=2, pp=2, ep=2, order="cp-ep-pp-dp-tp")
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _numbers_around(msg, word):
    """(last number before, first number after) each ``word`` in ``msg``."""
    out = []
    for m in re.finditer(word, msg):
        before = re.findall(r"\d+", msg[: m.start()])
        after = re.findall(r"\d+", msg[m.end() :])
        out.append((before[-1], after[0]))
    return out


def _small_layouts():
    for world, tp, pp, cp, ep in itertools.product((4, 8, 16), *[(1, 2, 4)] * 4):
        if world % (tp * cp * pp) or (world // (tp * pp)) % ep:
            continue  # refused for divisibility, not for the grid rules
        for order in CP_ORDERS:
            yield world, tp, pp, ep, order, cp


def test_small_layouts_accepted_iff_grid_rules_hold():
    accepted = refused = 0
    for world, tp, pp, ep, order, cp in _small_layouts():
        case = (world, tp, pp, ep, order, cp)
        broken = broken_rules(*case)
        try:
            layout = MeshLayout(world, tp=tp, pp=pp, ep=ep, order=order, cp=cp)
        except ValueError as e:
            msg = str(e)
            assert broken, (case, msg)
            refused += 1
            assert "\n" not in msg and f"order '{layout_order(order, cp)}'" in msg, (case, msg)
            assert f"tp={tp} cp={cp} ep={ep}" in msg and f"pp={pp}" in msg, (case, msg)
            assert ("Megatron-Core forbids" in msg) == bool(broken & {"a", "b"}), (case, msg)
            if "a" in broken:
                assert "pp = 1, or equal data-parallel sizes" in msg, (case, msg)
            elif "b" in broken:
                assert "rule: equal pipeline groups" in msg, (case, msg)
            else:
                assert "fastpar's rule (not Megatron-Core's)" in msg, (case, msg)
            for x, y in _numbers_around(msg, "differs") + _numbers_around(msg, "but stage"):
                assert x != y, (case, msg)
            _check_claims(case, msg)
            continue
        assert not broken, (case, broken)
        accepted += 1
        groups = layout.groups
        want = numpy_oracle(*case)
        assert groups == want, case
        stage = {r: s for g in want["pp"] for s, r in enumerate(g)}
        tp_rank = {r: i for g in want["tp"] for i, r in enumerate(g)}
        for kind in ("expert-dp", "ep", "tp-ep"):
            for g in groups[kind]:
                assert len({stage[r] for r in g}) == 1, (case, kind, g)
        for g in groups["ep"]:
            assert len({tp_rank[r] for r in g}) == 1, (case, g)
    assert accepted > 1000 and refused > 1000, (accepted, refused)


def layout_order(order, cp):
    """The order as a layout reports it: cp named only when cp > 1."""
    return "-".join(t for t in _tokens(order, cp) if cp > 1 or t != "cp")


def _check_claims(case, msg):
    """The rank a message names really moves stage, or really has another tp group."""
    world, tp, pp, ep, order, cp = case
    tokens = _tokens(order, cp)
    dense, expert = _np_sizes(world, tp, pp, ep, cp)
    m = re.search(r"rank (\d+) is in stage (\d+) of the dense grid but stage (\d+)", msg)
    if m:
        r, ds, es = map(int, m.groups())
        d = next(g for g in _np_groups(world, tokens, dense, "pp") if r in g)
        e = next(g for g in _np_groups(world, tokens, expert, "pp") if r in g)
        assert (d.index(r), e.index(r)) == (ds, es), (case, msg)
    m = re.search(r"rank (\d+) the tp group \[([\d, ]+)\] in the dense grid but \[([\d, ]+)\]", msg)
    if m:
        r = int(m.group(1))
        d = next(g for g in _np_groups(world, tokens, dense, "tp") if r in g)
        e = next(g for g in _np_groups(world, tokens, expert, "tp") if r in g)
        assert (str(d)[1:-1], str(e)[1:-1]) == (m.group(2), m.group(3)), (case, msg)


def test_group_of_and_bad_rank():
    layout = MeshLayout(8, tp=2, pp=2)
    assert layout.group_of("dp", 5) == [5, 7]
    assert layout.group_of("embedding", 5) == [1, 5]
    with pytest.raises(ValueError, match=r"rank 8 is outside the world \[0, 8\)"):
        layout.coords(8)
    with pytest.raises(KeyError, match="unknown group kind 'sp'"):
        layout.group_of("sp", 0)
