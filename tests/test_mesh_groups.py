"""ParallelMesh on real gloo ranks: every group reduces over exactly the ranks rank_groups lists."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import fastpar
from fastpar.mesh import GROUP_KINDS, MeshLayout, ParallelMesh, group_timeout
from fastpar.mesh.check import group_sums, members
from fastpar.testing import RankError, run_ranks

LAYOUTS = [
    (4, dict(tp=2)),
    (4, dict(pp=2, ep=2)),
    (4, dict(tp=2, pp=2)),
    (4, dict(ep=4)),
    (8, dict(tp=2, pp=2, ep=2)),
    (8, dict(tp=2, pp=4)),
    (8, dict(pp=2, ep=4)),
    (8, dict(tp=2, ep=2, order="tp-dp-ep-pp")),
    (8, dict(tp=2, pp=2, order="pp-dp-tp-ep")),
    (8, dict(tp=2, cp=2)),
    (8, dict(cp=2, pp=2, ep=2)),
    # cp after dp: cp ranks stride by tp·dp (a cp-first order is refused: the expert grid's tp
    # lines would not be the dense grid's, and fastpar's experts split over the dense tp group)
    (8, dict(tp=2, cp=2, order="tp-dp-cp-ep-pp")),
    # hybrid sharding: dp = dp_shard x dp_replicate
    (8, dict(tp=2, dp_shard=2)),
    (8, dict(cp=2, ep=2, dp_shard=2)),
]


@pytest.mark.parametrize("world,kw", LAYOUTS, ids=[f"w{w}-{kw}" for w, kw in LAYOUTS])
def test_groups_reduce_over_listed_ranks(world, kw):
    layout = MeshLayout(world, **kw)
    results = run_ranks(
        group_sums,
        world,
        kw.get("tp", 1),
        kw.get("pp", 1),
        kw.get("ep", 1),
        kw.get("order", "tp-ep-dp-pp"),
        kw.get("cp", 1),
        kw.get("dp_shard"),
    )
    for rank, res in enumerate(results):
        for kind in GROUP_KINDS:
            expected = layout.group_of(kind, rank)
            ranks, bits = res[kind]
            assert ranks == expected, (rank, kind)
            assert (members(bits) if bits is not None else []) == expected, (rank, kind)
        c = res["coords"]
        kinds = ("tp", "pp", "dp", "cp", "ep", "expert-dp", "dp-shard", "dp-replicate")
        assert {k: c[k] for k in kinds} == layout.coords(rank)
        pp_group = layout.group_of("pp", rank)
        assert c["first"] == (pp_group[0] == rank) and c["last"] == (pp_group[-1] == rank)
        i = pp_group.index(rank)
        assert c["next"] == (pp_group[i + 1] if i + 1 < len(pp_group) else None)
        assert c["prev"] == (pp_group[i - 1] if i > 0 else None)


def _bad_mesh():
    return ParallelMesh(tp=3)


def test_mesh_refuses_bad_layout_on_ranks():
    with pytest.raises(RankError, match=r"world_size 4 is not divisible by tp\*pp = 3\*1") as info:
        run_ranks(_bad_mesh, 4)
    assert isinstance(info.value.exception, ValueError)


def test_mesh_needs_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs an initialised default process group"):
        ParallelMesh()


def _run_script(code, env_extra, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_init_without_torchrun_is_one_rank_world():
    out = _run_script(
        """
        import fastpar
        mesh = fastpar.init()
        print(mesh.world_size, mesh.tp_size, mesh.dp_size, mesh.is_first_stage, mesh.is_last_stage)
        """,
        {},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1", "True", "True"]


def test_init_refuses_bad_layout_before_any_group():
    out = _run_script(
        """
        import torch.distributed as dist, fastpar
        try:
            fastpar.init(tp=3)
        except ValueError as e:
            print("refused:", e, "| initialised:", dist.is_initialized())
        """,
        {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "refused: world_size 4 is not divisible by tp*pp = 3*1" in out.stdout
    assert "initialised: False" in out.stdout


def test_init_under_plain_python_points_at_torchrun_and_run_ranks():
    out = _run_script(
        """
        import torch.distributed as dist, fastpar
        try:
            fastpar.init(tp=2)
        except RuntimeError as e:
            print("refused:", e, "| initialised:", dist.is_initialized())
        """,
        {},
    )
    assert out.returncode == 0, out.stderr
    assert "needs 2 or more ranks" in out.stdout
    assert "torchrun --nproc-per-node 2" in out.stdout
    assert "fastpar.launch.run_ranks(fn, 2)" in out.stdout
    assert "pp must be one of []" not in out.stdout
    assert "initialised: False" in out.stdout


def test_a_layout_no_pipeline_size_fixes_names_no_empty_list():
    from fastpar.mesh.layout import MeshLayout

    with pytest.raises(ValueError, match=r"with tp=4, use a world size that is a multiple of 4"):
        MeshLayout(2, tp=4)


def test_init_half_set_environment_is_an_error():
    out = _run_script("import fastpar\nfastpar.init()\n", {"RANK": "0"})
    assert out.returncode != 0
    assert "RANK and WORLD_SIZE must be set together" in out.stderr


@pytest.mark.slow
def test_init_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist, fastpar
            from fastpar.mesh import GROUP_KINDS, group_timeout
            mesh = fastpar.init(tp=2, pp=2, timeout=42)
            t = torch.tensor([2.0 ** mesh.rank])
            dist.all_reduce(t, group=mesh.pp_group)
            line = f"rank {mesh.rank} tp {mesh.tp_rank} pp {mesh.pp_rank} ppsum {int(t.item())}"
            groups = [group_timeout()] + [mesh.group(k) and group_timeout(mesh.group(k)) for k in GROUP_KINDS]
            line += " timeouts " + str(sorted({g.total_seconds() for g in groups if g is not None}))
            with open(f"{__file__}.{mesh.rank}.out", "w") as f:
                f.write(line)
            dist.barrier()  # nobody tears gloo down while a peer still talks to it
            dist.destroy_process_group()
            """
        )
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    out = subprocess.run(
        [*torchrun, "--standalone", "--nproc-per-node", "4", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [(tmp_path / f"job.py.{r}.out").read_text() for r in range(4)]
    # pp groups of 4 ranks, tp=2, pp=2: [0, 2] and [1, 3]; sums 2^0+2^2 = 5, 2^1+2^3 = 10
    assert lines == [  # and the world and every group time out after the 42 s given to init
        "rank 0 tp 0 pp 0 ppsum 5 timeouts [42.0]",
        "rank 1 tp 1 pp 0 ppsum 10 timeouts [42.0]",
        "rank 2 tp 0 pp 1 ppsum 5 timeouts [42.0]",
        "rank 3 tp 1 pp 1 ppsum 10 timeouts [42.0]",
    ]


# -- one collective timeout for every group ----------------------------------------------------
def _group_timeouts(timeout):
    mesh = ParallelMesh(tp=2, pp=2, timeout=timeout)  # world 4: mp = tp x pp spans the world
    seconds = {
        kind: group_timeout(mesh.group(kind)).total_seconds()
        for kind in GROUP_KINDS
        if mesh.group(kind) is not None
    }
    return mesh.timeout.total_seconds(), seconds


@pytest.mark.parametrize("given,expected", [(33, 33.0), (None, 77.0)], ids=["given", "inherited"])
def test_every_group_gets_the_mesh_timeout(given, expected):
    # the default group times out after 77 s; the mesh after `given` s, or the default group's
    for mesh_timeout, seconds in run_ranks(_group_timeouts, 4, given, collective_timeout=77):
        assert mesh_timeout == expected
        assert set(seconds) >= set(GROUP_KINDS) - {"embedding"}
        assert seconds == {kind: expected for kind in seconds}


def _sub_group_timeout():
    mesh = ParallelMesh(tp=2)  # no timeout given: the default group's 2 s
    if mesh.rank != 0:  # rank 1, rank 0's tp peer, never joins (it waits in the final barrier)
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.tp_group)
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    return time.monotonic() - t0, "no error"


def test_a_stuck_peer_times_out_a_sub_group_collective():
    waited, error = run_ranks(_sub_group_timeout, 4, timeout=60, collective_timeout=2)[0]
    assert "Timed out" in error
    assert 1.5 < waited < 10  # the mesh's 2 s, not torch's 30 min


def test_timeout_must_be_positive_seconds_or_a_timedelta():
    with pytest.raises(
        ValueError, match=r"timeout must be a positive, finite number of seconds, got 0"
    ):
        fastpar.init(timeout=0)
    with pytest.raises(
        TypeError, match=r"timeout must be a datetime\.timedelta or a number of seconds"
    ):
        fastpar.init(timeout="5")
    assert not dist.is_initialized()


def test_init_sets_one_timeout_for_the_world_and_every_group():
    out = _run_script(
        """
        import fastpar
        from fastpar.mesh import group_timeout, GROUP_KINDS
        mesh = fastpar.init(timeout=7)
        print(group_timeout().total_seconds(), mesh.timeout.total_seconds(),
              sorted({group_timeout(mesh.group(k)).total_seconds() for k in GROUP_KINDS}))
        """,
        {},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["7.0", "7.0", "[7.0]"]
