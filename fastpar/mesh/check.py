"""Create a mesh's process groups on real ranks and prove each one reduces over exactly its ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.layout import GROUP_KINDS


def group_sums(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    order: str = "tp-ep-dp-pp",
    cp: int = 1,
    dp_shard: int | None = None,
) -> dict:
    """On every rank: build the mesh, all-reduce 2**rank over each of its groups.

    Returns {kind: (ranks of this rank's group, the all-reduced sum)}; the sum of 2**r has one
    bit per member, so it names exactly which ranks took part.
    """
    mesh = ParallelMesh(tp, pp, ep, order=order, cp=cp, dp_shard=dp_shard)
    out = {}
    for kind in GROUP_KINDS:
        group = mesh.group(kind)
        if group is None:
            out[kind] = ([], None)
            continue
        t = torch.tensor([2**mesh.rank], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        out[kind] = (mesh.ranks(kind), int(t.item()))
    out["coords"] = {
        "tp": mesh.tp_rank,
        "pp": mesh.pp_rank,
        "dp": mesh.dp_rank,
        "cp": mesh.cp_rank,
        "ep": mesh.ep_rank,
        "expert-dp": mesh.expert_dp_rank,
        "dp-shard": mesh.dp_shard_rank,
        "dp-replicate": mesh.dp_replicate_rank,
        "first": mesh.is_first_stage,
        "last": mesh.is_last_stage,
        "next": mesh.next_rank,
        "prev": mesh.prev_rank,
    }
    return out


def members(bits: int) -> list[int]:
    """Ranks whose bit is set in ``bits`` (the inverse of summing 2**rank)."""
    return [r for r in range(bits.bit_length()) if bits >> r & 1]
