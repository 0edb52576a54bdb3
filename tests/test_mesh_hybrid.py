"""Hybrid sharded data parallelism in the mesh: dp = dp_shard × dp_replicate, the shard part the
faster (consecutive dp ranks, node-local), against hand-written group lists for several world
sizes; torchtitan's DeviceMesh dims ("dp_replicate", "dp_shard") hold the same groups; a bad
S × R is refused naming the numbers and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fastpar import ParallelMesh
from fastpar.mesh import MeshLayout, rank_groups
from fastpar.mesh.__main__ import main
from fastpar.mesh.bridge import groups_along
from fastpar.mesh.layout import resolve_dp
from fastpar.testing import run_ranks

# (world, layout keywords) -> the groups, written out by hand
EXPECTED = [
    (
        dict(world_size=4, dp_shard=2),
        {
            "dp": [[0, 1, 2, 3]],
            "dp-shard": [[0, 1], [2, 3]],
            "dp-replicate": [[0, 2], [1, 3]],
            "dp-shard-cp": [[0, 1], [2, 3]],
        },
    ),
    (
        dict(world_size=8, dp_replicate=4),  # dp_shard follows: 2
        {
            "dp-shard": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp-replicate": [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
    ),
    (
        dict(world_size=8, tp=2, dp_shard=2, dp_replicate=2),
        {
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "dp-shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp-replicate": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (  # rank = tp + 2·dp + 8·pp
        dict(world_size=16, tp=2, pp=2, dp_shard=2),
        {
            "dp-shard": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
            "dp-replicate": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        },
    ),
    (  # rank = cp + 2·dp: ZeRO shards over cp × dp_shard, four consecutive ranks
        dict(world_size=8, cp=2, dp_shard=2),
        {
            "dp-shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp-replicate": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp-shard-cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        },
    ),
    (  # experts: ep 2 inside each shard block, expert-dp = 4 = 2 shard x 2 replicate
        dict(world_size=8, ep=2, dp_shard=4),
        {
            "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp-shard": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "expert-dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "expert-dp-shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "expert-dp-replicate": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
]


@pytest.mark.parametrize("kwargs, expected", EXPECTED)
def test_groups_are_the_hand_written_ones(kwargs, expected):
    groups = rank_groups(**kwargs)
    for kind, want in expected.items():
        assert groups[kind] == want, kind
    layout = MeshLayout(**kwargs)
    assert layout.dp_shard * layout.dp_replicate == layout.dp
    for r in range(layout.world_size):  # the dp coordinate is shard + S x replica
        c = layout.coords(r)
        assert c["dp"] == c["dp-shard"] + layout.dp_shard * c["dp-replicate"], r


@pytest.mark.parametrize(
    "kwargs",
    [dict(world_size=8, tp=2), dict(world_size=12, pp=3), dict(world_size=8, cp=2, ep=2)],
)
def test_dp_alone_is_full_sharding(kwargs):
    """Without dp_shard / dp_replicate nothing changes: the shard group is dp (x cp), the
    replicate groups single ranks, and the layout is the one of dp_shard = dp."""
    layout = MeshLayout(**kwargs)
    g = layout.groups
    assert (layout.dp_shard, layout.dp_replicate, layout.hybrid) == (layout.dp, 1, False)
    assert g["dp-shard"] == g["dp"] and g["dp-shard-cp"] == g["dp-cp"]
    assert g["expert-dp-shard"] == g["expert-dp"]
    assert g["dp-replicate"] == [[r] for r in range(layout.world_size)]
    assert layout == MeshLayout(**kwargs, dp_shard=layout.dp)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(world_size=8, dp_shard=3, dp_replicate=2),
            r"dp_shard 3 x dp_replicate 2 = 6 is not dp = 8 .*dp_shard \* dp_replicate = 8, "
            r"e\.g\. dp_shard=4 dp_replicate=2",
        ),
        (
            dict(world_size=8, tp=2, dp_shard=3),
            r"dp_shard 3 does not divide dp = 4 .*one of \[1, 2, 4\]",
        ),
        (dict(world_size=8, dp_replicate=3), r"dp_replicate 3 does not divide dp = 8"),
        (dict(world_size=8, dp_shard=0), r"dp_shard must be a positive integer, got 0"),
        (dict(world_size=8, ep=4, dp_shard=2), r"ep to divide dp_shard\*cp = 2\*1 = 2"),
    ],
)
def test_bad_hybrid_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeshLayout(**kwargs)


@pytest.mark.parametrize(
    "given, resolved",
    [
        ((None, 2, 2), (4, 2, 2)),
        ((4, 2, None), (4, 2, 2)),
        ((4, None, 2), (4, 2, 2)),
        ((6, 3, 2), (6, 3, 2)),
        ((4, None, None), (4, None, None)),  # one of three: the layout gives the others
        ((None, 2, None), (None, 2, None)),
        ((None, None, None), (None, None, None)),
    ],
)
def test_any_two_of_dp_shard_and_replicate_give_the_third(given, resolved):
    assert resolve_dp(*given) == resolved


@pytest.mark.parametrize(
    "given, message",
    [
        ((4, 3, 2), r"^dp 4, dp_shard 3 and dp_replicate 2 disagree: dp must be dp_shard x "),
        ((4, 3, None), r"^dp_shard 3 does not divide dp 4; dp_shard must be one of \[1, 2, 4\]"),
        ((4, None, 3), r"^dp_replicate 3 does not divide dp 4"),
        ((0, None, None), r"^dp must be a positive integer, got 0"),
    ],
)
def test_a_contradiction_of_the_three_is_one_line_naming_them(given, message):
    with pytest.raises(ValueError, match=message) as info:
        resolve_dp(*given)
    assert "\n" not in str(info.value)


def test_init_checks_dp_against_the_world(monkeypatch):
    """``fastpar.init(dp=...)`` against WORLD_SIZE, before any process group exists; and in
    one process with no torchrun, the ranks dp_shard x dp_replicate need."""
    from fastpar.mesh import init

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ValueError, match=r"dp 8 needs a world of .* = 8 ranks, but WORLD_SIZE is 4"
    ):
        init(dp_shard=2, dp_replicate=4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match=r"needs 4 or more ranks"):
        init(dp_shard=2, dp_replicate=2)


def test_torchtitan_device_mesh_dims_hold_the_same_groups():
    """torchtitan lays its mesh out (pp, dp_replicate, dp_shard, cp, tp), slowest first: the
    groups along its dims are fastpar's dp-replicate / dp-shard / cp / tp groups."""
    layout = MeshLayout(32, tp=2, cp=2, pp=2, dp_shard=2)
    ranks = torch.arange(32).reshape(2, 2, 2, 2, 2)
    names = ("pp", "dp-replicate", "dp-shard", "cp", "tp")
    for dim, kind in enumerate(names):
        assert sorted(groups_along(ranks, dim)) == sorted(layout.groups[kind]), kind


def test_cli_prints_the_groups(capsys):
    assert main(["--world-size", "8", "--tp", "2", "--dp-shard", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp-shard=2  dp-replicate=2" in out
    assert "dp-shard (4 groups)" in out and "[0, 2] [1, 3] [4, 6] [5, 7]" in out
    assert "dp-replicate (4 groups)" in out and "[0, 4] [1, 5] [2, 6] [3, 7]" in out
    assert main(["--world-size", "8", "--dp-shard", "3", "--dp-replicate", "2"]) == 2
    assert "--world-size 8 is not tp x cp x pp x dp = 1 x 1 x 1 x 6 = 6" in capsys.readouterr().err
    assert main(["--world-size", "8", "--tp", "4", "--dp-shard", "3"]) == 2
    assert "dp_shard 3 does not divide dp = 2" in capsys.readouterr().err


def test_cli_takes_the_world_from_the_dp_flags(capsys):
    assert main(["--tp", "2", "--dp-shard", "2", "--dp-replicate", "2"]) == 0
    assert "world_size=8  tp=2" in capsys.readouterr().out
    assert main(["--tp", "2", "--dp", "4", "--dp-replicate", "2"]) == 0
    assert "dp-shard=2  dp-replicate=2" in capsys.readouterr().out
    assert main(["--dp", "4", "--dp-shard", "2", "--dp-replicate", "4"]) == 2
    err = capsys.readouterr().err
    assert "--dp 4, --dp-shard 2 and --dp-replicate 4 disagree" in err
    assert main(["--tp", "2"]) == 2
    assert "give --world-size, or --dp" in capsys.readouterr().err


def _bridge() -> dict:
    mesh = ParallelMesh(dp_shard=2)
    out = {"repr": repr(mesh), "sizes": (mesh.dp_shard_size, mesh.dp_replicate_size)}
    t = torch.tensor([2.0**mesh.rank])
    dist.all_reduce(t, group=mesh.dp_shard_group)
    out["shard_sum"] = int(t)
    dm = mesh.to_device_mesh()
    assert dm.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert dm["dp_shard"].get_group() is mesh.dp_shard_group
    assert dm["dp_replicate"].get_group() is mesh.dp_replicate_group
    back = ParallelMesh.from_device_mesh(dm)
    assert back.dp_shard_group is mesh.dp_shard_group
    user = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    got = ParallelMesh.from_device_mesh(user)
    assert got.dp_shard_group is user.get_group("dp_shard")
    assert got.dp_replicate_group is user.get_group("dp_replicate")
    out["titan"] = (got.ranks("dp-shard"), got.ranks("dp-replicate"), got.layout.dp_shard)
    return out


def test_parallel_mesh_groups_and_the_device_mesh_bridge():
    for rank, out in enumerate(run_ranks(_bridge, 4)):
        shard, rep = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert out["sizes"] == (2, 2)
        assert f"dp_shard={rank % 2}/2, dp_replicate={rank // 2}/2" in out["repr"]
        assert out["shard_sum"] == sum(2**r for r in shard)
        assert out["titan"] == (shard, rep, 2)
