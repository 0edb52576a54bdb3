"""The placement rule on real gloo ranks: which groups replicate a parameter, and which one rank
holds its reference copy, for every kind of mark; expectations from the mesh's coordinates."""

from __future__ import annotations

import pytest
import torch

from fastpar.mesh import ParallelMesh
from fastpar.mesh.placement import (
    data_parallel_group,
    data_parallel_groups,
    holds_reference_copy,
    mark_duplicated,
    mark_expert,
    mark_replicated,
    mark_sharded,
    replica_groups,
)
from fastpar.mesh.ranks import global_rank, group_rank, group_size
from fastpar.testing import run_ranks


def _placement(tp: int, ep: int) -> dict:
    mesh = ParallelMesh(tp=tp, ep=ep)
    plain = torch.nn.Parameter(torch.zeros(4))
    replicated = torch.nn.Parameter(torch.zeros(4))
    mark_replicated(replicated, mesh.tp_group)
    sharded = torch.nn.Parameter(torch.zeros(4, 2))
    mark_sharded(sharded, 0, mesh.tp_group, 4 * tp)
    tied = torch.nn.Parameter(torch.zeros(4, 2))  # a sharded tensor also held on another rank
    mark_sharded(tied, 0, mesh.tp_group, 4 * tp)
    mark_duplicated(tied, mesh.group("ep"))
    expert = torch.nn.Parameter(torch.zeros(2, 3))
    mark_expert(expert, mesh.ep_group, 2 * ep)
    params = {
        "plain": plain,
        "replicated": replicated,
        "sharded": sharded,
        "tied": tied,
        "expert": expert,
    }
    first = {k: holds_reference_copy(p, mesh) for k, p in params.items()}
    zero = {k: holds_reference_copy(p, mesh, data_parallel=False) for k, p in params.items()}
    no_ties = holds_reference_copy(tied, mesh, duplicates=False)
    assert replica_groups(sharded, mesh) == [mesh.dp_group]
    assert replica_groups(tied, mesh, data_parallel=False) == [mesh.group("ep")]
    assert replica_groups(plain, None, group=mesh.tp_group) == [mesh.tp_group]
    assert data_parallel_groups(mesh) == (mesh.dp_group, mesh.expert_dp_group)
    assert data_parallel_groups(None, mesh.tp_group) == (mesh.tp_group, mesh.tp_group)
    assert data_parallel_group(expert, mesh) is mesh.expert_dp_group
    assert data_parallel_group(plain, mesh) is mesh.dp_group
    ranks = (group_rank(mesh.dp_group), group_size(mesh.dp_group))
    return {
        "coords": (mesh.tp_rank, mesh.dp_rank, mesh.ep_rank, mesh.expert_dp_rank),
        "first": first,
        "zero": zero,
        "no_ties": no_ties,
        "dp": ranks,
        "dp_first": global_rank(mesh.dp_group, 0),
        "dp_ranks": mesh.ranks("dp"),
    }


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_reference_copy_per_mark(tp, ep):
    for out in run_ranks(_placement, 4, tp, ep):
        tp_rank, dp_rank, ep_rank, edp_rank = out["coords"]
        assert out["first"] == {
            "plain": tp_rank == 0 and dp_rank == 0,  # replicated over TP and DP
            "replicated": tp_rank == 0 and dp_rank == 0,
            "sharded": dp_rank == 0,  # one slice per TP rank, replicated over DP
            "tied": dp_rank == 0 and ep_rank == 0,
            "expert": tp_rank == 0 and edp_rank == 0,  # unsplit over TP; one per EP rank
        }
        assert out["zero"] == {
            "plain": tp_rank == 0,
            "replicated": tp_rank == 0,
            "sharded": True,
            "tied": ep_rank == 0,
            "expert": tp_rank == 0,
        }
        assert out["no_ties"] == (dp_rank == 0)
        assert out["dp"] == (dp_rank, 4 // tp)
        assert out["dp_first"] == out["dp_ranks"][0]


def test_without_torch_distributed_every_group_is_this_process():
    p = torch.nn.Parameter(torch.zeros(3))
    assert (group_rank(None), group_size(None), global_rank(None, 2)) == (0, 1, 2)
    assert replica_groups(p) == [None] and holds_reference_copy(p)
