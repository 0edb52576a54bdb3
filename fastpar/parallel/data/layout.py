"""How a data-parallel wrapper lays its parameters out in flats (``FlatShard``), which tensors
each flat keeps at its ZeRO stage, and which ranges of them the gradient norm counts (the order
of the flats: docs/layouts.md, "Buckets").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastpar.amp.norm import counts_on_this_rank
from fastpar.mesh.placement import duplicated_over, is_expert
from fastpar.parallel.data.buckets import build_buckets
from fastpar.parallel.data.flat import FlatShard
from fastpar.parallel.data.units import Units


@dataclass(frozen=True)
class FlatKey:
    """What a flat holds: parameters of one optimizer ``param_group``, dense or ``expert``, of
    one ZeRO-3 ``unit``, ``persistent`` (replicated at stage 3) or not, ``tied`` over groups."""

    param_group: int
    expert: bool
    unit: int = 0
    persistent: bool = False
    tied: tuple = ()


def _lists(groups, params, units: Units | None, persist_below: int) -> tuple[list, list]:
    """(lists of parameters, one per future flat or bucket family; their ``FlatKey``)."""
    lists: list[list[nn.Parameter]] = []
    keys: list[FlatKey] = []

    def add(members: list[nn.Parameter], key: FlatKey) -> None:
        lists.append(members)
        keys.append(key)

    if units is None:
        for gi, g in enumerate(groups):
            for expert in (False, True):
                mine = [p for p in g if is_expert(p) == expert and p.requires_grad]
                add([p for p in mine if not duplicated_over(p)], FlatKey(gi, expert))
                for p in mine:
                    if duplicated_over(p):
                        add([p], FlatKey(gi, expert, tied=duplicated_over(p)))
        return lists, keys
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
    owner = units.owners()
    for ui in range(len(units.units)):
        keyed: dict[tuple, list[nn.Parameter]] = {}
        for p in params:  # registration order
            if owner.get(id(p)) != ui or id(p) not in group_of:
                continue
            persistent = p.numel() < persist_below
            key = FlatKey(group_of[id(p)], is_expert(p), ui, persistent, duplicated_over(p))
            if key.tied:
                add([p], key)
            else:
                keyed.setdefault((key, p.dtype), []).append(p)
        for (key, _), members in keyed.items():
            add(members, key)
    return lists, keys


def plan_flats(dp, groups, params, bucket_size_mb, units: Units | None, persist_below: int):
    """The flats of wrapper ``dp`` (module docstring), without tensors yet."""
    lists, keys = _lists(groups, params, units, persist_below)
    sharded = [dp.stage > 0 and not k.persistent for k in keys]
    pads = [dp._kinds[k.expert][1] if s else 1 for k, s in zip(keys, sharded, strict=True)]
    buckets = build_buckets(lists, bucket_size_mb, pads, reverse=units is None)
    flats = []
    for b in buckets:
        key = keys[b.group_index]
        shards = sharded[b.group_index]  # replicated flats: over the whole dp (x cp)
        g, size, rank = (dp._kinds if shards else dp._full)[key.expert]
        flats.append(
            FlatShard(
                b,
                g,
                size,
                rank,
                shards,
                dp.comm_bytes_by,
                param_group=key.param_group,
                expert=key.expert,
                unit=key.unit,
                tied=key.tied,
                replicate=dp._replicas[key.expert] if shards else None,
            )
        )
    if units is not None:  # reduction order ~ backward order
        flats.sort(key=lambda f: -f.unit)
        for i, f in enumerate(flats):
            f.bucket.index = i
    return flats


@torch.no_grad()
def allocate(dp, f: FlatShard, optimizer: bool) -> None:
    """Flat ``f``'s tensors at ``dp``'s stage (``optimizer`` False: gradient synchronisation
    only, the parameters stay the module's own)."""
    b, device = f.bucket, f.params[0].device
    f.in_place = dp.stage == 0
    f.grad_persistent = dp.stage in (0, 1)
    if f.grad_persistent:
        f.grad = torch.zeros(f.padded, dtype=f.dtype, device=device)
        f.grad_views = [b.view(f.grad, i) for i in range(len(f.params))]
        for p, v in zip(f.params, f.grad_views, strict=True):
            p.grad = v
    if not optimizer:
        return
    f.full = torch.zeros(f.padded, dtype=f.dtype, device=device)
    for i, p in enumerate(f.params):
        b.view(f.full, i).copy_(p.data)
    if dp.stage == 3 and f.sharded:  # the full buffer is freed once the units take it
        f.shard = f.full[f.mine].clone()
        f.empties = [torch.empty(0, dtype=f.dtype, device=device) for _ in f.params]
    else:
        for i, p in enumerate(f.params):
            p.data = b.view(f.full, i)
    base = f.shard if f.shard is not None else f.full[f.mine]
    if f.dtype == torch.float32:  # the fp32 parameters are the master
        f.master = nn.Parameter(base)
    else:
        f.master = nn.Parameter(base.float().clone())
    fp32_comm = dp.reduce_dtype in (None, torch.float32)
    if f.in_place and f.dtype == torch.float32:
        f.reduced = f.grad  # DDP: .grad holds the average; the step reads it
    elif dp.stage == 1 and f.sharded and f.dtype == torch.float32 and fp32_comm:
        f.reduced, f.reduced_in_grad = f.grad[f.mine], True  # ZeroRedundancyOptimizer's size
    else:
        f.reduced = torch.zeros(f.shard_len, dtype=torch.float32, device=device)
    f.master.grad = f.reduced


def counted(dp, p: nn.Parameter, f: FlatShard) -> bool:
    """Whether this rank's part of ``p`` in flat ``f`` enters the global norm: each element
    once (``fastpar.amp.norm.counts_on_this_rank``; replicated flats on their group's rank 0;
    hybrid sharding: a shard on its replicate group's rank 0)."""
    if f.replicate_rank != 0:
        return False
    if dp.mesh is not None:
        return counts_on_this_rank(p, mesh=dp.mesh, dp_replicated=not f.sharded)
    return f.sharded or counts_on_this_rank(p, group=dp.group)


def norm_passes(dp) -> list:
    """(gradients, fp32 outputs or None, counted) for the step's unscale + norm pass: this
    rank's range of each flat, in runs of parameters counted alike (stage 0, low precision:
    from ``grad`` into ``reduced``; else ``reduced`` in place)."""
    passes = []
    for f in dp.flats:
        if f.reduced is None:
            continue
        src = f.grad if f.in_place else f.reduced
        runs: list[list] = []
        for o in f.owned():
            c = counted(dp, f.params[o.index], f)
            if runs and runs[-1][0] == c and runs[-1][2] == o.shard_start:
                runs[-1][2] = o.shard_stop
            else:
                runs.append([c, o.shard_start, o.shard_stop])
        for c, a, z in runs:  # (a replicated flat's range is all of it: lo = 0)
            out = None if src is f.reduced else [f.reduced[a:z]]
            passes.append(([src[a:z]], out, c))
    return passes
