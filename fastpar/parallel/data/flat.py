"""``FlatShard``: one flat buffer of parameters — its layout, its padding, the range this rank
owns, and the collectives over it; every data-parallel stage is built on it. Its tensors and
its two reduction rules: docs/layouts.md ("The data-parallel family")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fastpar.comm import plain
from fastpar.mesh.ranks import Group, global_rank, group_rank, group_size
from fastpar.parallel.data.buckets import Bucket, payload_bytes

# states of a ZeRO-3 flat's full parameters
FREE = "free"  # params point at empty tensors, full storage has 0 bytes
RESHARDED = "resharded"  # after forward: params keep their views, full storage has 0 bytes
GATHERING = "gathering"  # all-gather in flight
GATHERED = "gathered"


class Owned(NamedTuple):
    """Elements [start, stop) of parameter ``index`` of a flat (flattened, local shape) that this
    rank owns; they sit at [shard_start, shard_stop) of the flat's shard."""

    index: int
    start: int
    stop: int
    shard_start: int
    shard_stop: int

    @property
    def first(self) -> bool:
        """Whether this rank owns the parameter's element 0 (the one that writes its "step")."""
        return self.start == 0

    @property
    def in_shard(self) -> slice:
        return slice(self.shard_start, self.shard_stop)


class _Works:
    """Several work handles waited as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class _Then:
    """A work handle, then a second collective started once it is done (``then()``: its work
    or None): hybrid sharding's all-reduce over the replicas of the reduce-scattered shard."""

    def __init__(self, first, then) -> None:
        self.first, self.then = first, then

    def wait(self) -> None:
        if self.then is None:  # waited before: the second collective ran once
            return
        if self.first is not None:
            self.first.wait()
        second, self.then = self.then(), None
        if second is not None:
            second.wait()


@dataclass(eq=False)
class FlatShard:
    """One flat buffer (docs/layouts.md): ``bucket`` (layout, reducer state), the ``group`` of
    ``size`` ranks sharding it (this rank ``rank``), ``sharded`` or replicated, the optimizer
    ``param_group``, ``expert`` (sharded over the expert-data-parallel group), the ZeRO-3
    ``unit``, the groups it is ``tied`` over (a parameter held on several pipeline stages),
    ``counts`` (the owner's bytes-sent counters) and, under hybrid sharding, the ``replicate``
    group over which every rank holds the same shard (its reduced gradient all-reduced there)."""

    bucket: Bucket
    group: Group
    size: int
    rank: int
    sharded: bool
    counts: dict[str, float]
    param_group: int = 0
    expert: bool = False
    unit: int = 0
    tied: tuple = ()
    replicate: Group = None
    in_place: bool = False
    grad_persistent: bool = False
    reduced_in_grad: bool = False  # ZeRO-1, fp32: ``reduced`` is grad[lo:lo+S]
    full: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    master: nn.Parameter | None = None
    reduced: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    grad_views: list[torch.Tensor] = field(default_factory=list)  # kept ``grad``: the .grad
    # a backward wrote ``grad`` since it was last cleared; the ZeRO-1 shard already holds a
    # reduction (until zero_grad); stage 0: a reduction reached ``grad``, its tied sum is due
    dirty: bool = False
    holds_reduced: bool = False
    tied_pending: bool = False
    # ZeRO-3: the full parameters' state, the gather in flight, the empty stand-ins
    state: str = GATHERED
    work: object = None
    empties: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gloo = dist.is_initialized() and dist.get_backend(self.group) == "gloo"
        hybrid = self.replicate is not None
        self.replicate_size = group_size(self.replicate) if hybrid else 1
        self.replicate_rank = group_rank(self.replicate) if hybrid else 0

    # -- layout ----------------------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        return self.bucket.params

    @property
    def shapes(self) -> list[torch.Size]:
        return self.bucket.shapes

    @property
    def dtype(self) -> torch.dtype:
        return self.bucket.dtype

    @property
    def padded(self) -> int:
        return self.bucket.padded_numel

    @property
    def shard_len(self) -> int:
        return self.padded // self.size if self.sharded else self.padded

    @property
    def lo(self) -> int:
        return self.rank * self.shard_len if self.sharded else 0

    @property
    def full_bytes(self) -> int:
        return self.padded * self.bucket.dtype.itemsize

    @property
    def mine(self) -> slice:
        """This rank's range of a [padded] buffer."""
        return slice(self.lo, self.lo + self.shard_len)

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of a [padded] buffer, in the parameter's (local) shape."""
        return self.bucket.view(buffer, i)

    def owned(self) -> Iterator[Owned]:
        """Each parameter's part in this rank's range, in order (all of them when replicated)."""
        lo, hi = self.lo, self.lo + self.shard_len
        for i, shape in enumerate(self.shapes):
            off = self.bucket.offsets[i]
            a, z = max(off, lo), min(off + shape.numel(), hi)
            if a < z:
                yield Owned(i, a - off, z - off, a - lo, z - lo)

    def aliased(self) -> bool:
        """Whether the fp32 master is the parameters' own storage (fp32 parameters)."""
        base = self.shard if self.shard is not None else self.full
        if base is None or self.master is None:
            return False
        return self.master.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()

    # -- collectives ---------------------------------------------------------------------------
    def _count(self, kind: str, key: str, numel: int, element_size: int) -> None:
        self.counts[key] += payload_bytes(kind, numel, element_size, self.size)

    def all_reduce(self, t: torch.Tensor, key: str = "all_reduce"):
        """Start an in-place all-reduce (sum) of ``t`` over the group; None for one rank."""
        if self.size == 1:
            return None
        self._count("all_reduce", key, t.numel(), t.element_size())
        return plain.all_reduce(t, group=self.group, async_op=True)

    def reduce(self, comm: torch.Tensor):
        """Start summing the full gradient ``comm`` [padded] over the group, so that
        ``comm[self.mine]`` ends up holding this rank's part of the sum (sharded: a
        reduce-scatter, in place; replicated: an all-reduce). Returns the work or None."""
        if not self.sharded:
            return self.all_reduce(comm)
        work = None
        if self.size > 1:
            self._count("reduce_scatter", "reduce_scatter", comm.numel(), comm.element_size())
            if self.gloo:
                work = plain.all_reduce(comm, group=self.group, async_op=True)
            else:
                mine = comm[self.mine]
                work = plain.reduce_scatter_tensor(mine, comm, group=self.group, async_op=True)
        if self.replicate_size == 1:
            return work
        return _Then(work, lambda: self.all_reduce_replicas(comm[self.mine]))

    def all_reduce_replicas(self, shard: torch.Tensor):
        """Start the in-place all-reduce (sum) of this rank's reduced ``shard`` over the
        ``replicate`` group (hybrid sharding; counted as "replicate_all_reduce")."""
        n, e = shard.numel(), shard.element_size()
        self.counts["replicate_all_reduce"] += payload_bytes(
            "all_reduce", n, e, self.replicate_size
        )
        return plain.all_reduce(shard, group=self.replicate, async_op=True)

    def gather(self, key: str):
        """Start the all-gather of ``full`` from each rank's range ``full[self.mine]`` (in
        place; the caller has written its own range). Returns the work or None."""
        if self.size == 1:
            return None
        full = self.full
        self._count("all_gather", key, full.numel(), full.element_size())
        if self.gloo:
            s = self.shard_len
            return _Works(
                [
                    plain.broadcast(
                        full[r * s : (r + 1) * s],
                        src=global_rank(self.group, r),
                        group=self.group,
                        async_op=True,
                    )
                    for r in range(self.size)
                ]
            )
        return plain.all_gather_into_tensor(full, full[self.mine], group=self.group, async_op=True)
