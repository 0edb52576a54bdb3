"""``ParallelMesh``: the process groups of a ``MeshLayout``, created on every rank.

Every rank creates every group of every kind, in the same order (torch.distributed requires
``new_group`` to be called collectively); identical rank lists share one group object, and a
group spanning the whole world is the default group itself. Layers take the mesh (or one of
its groups) as an argument: nothing here is stored in a module-level global. Every group gets
the mesh's one collective timeout (``fastpar.mesh.timeout``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fastpar.flight.record import name_group, torch_buffer
from fastpar.mesh import bridge
from fastpar.mesh.layout import DEFAULT_ORDER, GROUP_KINDS, MeshLayout, resolve_dp
from fastpar.mesh.timeout import DEFAULT_TIMEOUT, as_timeout, group_timeout


class ParallelMesh:
    """This rank's place in a TP / PP / DP / EP layout, with a process group for each kind.

    Needs an initialised default process group (``torch.distributed.init_process_group`` or
    ``fastpar.init``). Sizes and this rank's coordinates ``<axis>_size`` / ``<axis>_rank`` (tp,
    pp, dp, cp, ep, expert_dp, dp_shard, dp_replicate); a group ``<kind>_group`` for each kind
    of ``fastpar.mesh.GROUP_KINDS`` ("-" spelt "_": ``tp_group``, ``expert_dp_group``, ...),
    which ``group(kind)`` and ``ranks(kind)`` also take; ``context_group``: the cp group, None
    without context parallelism; ``embedding_group`` is None on ranks that hold no embedding.
    Dense gradients are averaged over ``dp_cp_group``; ZeRO shards over ``dp_shard_cp_group``.

    ``timeout`` (a timedelta or seconds) bounds every collective of every group of the mesh: a
    peer that does not answer within it makes the collective raise instead of hanging. Default:
    the default group's own timeout, so the whole mesh shares one. ``timeout`` is the value used.
    """

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        *,
        order: str = DEFAULT_ORDER,
        timeout: timedelta | float | None = None,
        cp: int = 1,
        dp_shard: int | None = None,
        dp_replicate: int | None = None,
        _provided: dict[tuple[int, ...], dist.ProcessGroup | None] | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelMesh needs an initialised default process group: call "
                "fastpar.init(tp=..., pp=..., ep=...) under torchrun, or "
                "torch.distributed.init_process_group(...) first"
            )
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.layout = MeshLayout(
            self.world_size,
            tp=tp,
            pp=pp,
            ep=ep,
            order=order,
            cp=cp,
            dp_shard=dp_shard,
            dp_replicate=dp_replicate,
        )
        world_timeout = group_timeout()
        if timeout is None:
            timeout = world_timeout or DEFAULT_TIMEOUT
        self.timeout = as_timeout(timeout)
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._ranks: dict[str, list[int]] = {}
        created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        world = tuple(range(self.world_size))
        kinds_of: dict[tuple[int, ...], list[str]] = {}  # the flight recorder's group names
        for kind in GROUP_KINDS:
            for ranks in self.layout.groups[kind]:
                kinds_of.setdefault(tuple(ranks), []).append(kind)
        for kind in GROUP_KINDS:
            for ranks in self.layout.groups[kind]:
                key = tuple(ranks)
                if key not in created:
                    if _provided is not None and key in _provided:  # from_device_mesh
                        created[key] = _provided[key]
                    elif key == world and world_timeout == self.timeout:
                        created[key] = dist.group.WORLD
                    else:  # every group its own timeout= (torch's default is 30 min)
                        created[key] = dist.new_group(
                            list(ranks), timeout=self.timeout, group_desc="/".join(kinds_of[key])
                        )
                    if self.rank in ranks and created[key] is not None:
                        name_group(created[key], kinds_of[key])
                if self.rank in ranks:
                    self._groups[kind] = created[key]
                    self._ranks[kind] = list(ranks)
            self._groups.setdefault(kind, None)
            self._ranks.setdefault(kind, [])

        coords = self.layout.coords(self.rank)
        self.tp_size, self.tp_rank = self.layout.tp, coords["tp"]
        self.pp_size, self.pp_rank = self.layout.pp, coords["pp"]
        self.dp_size, self.dp_rank = self.layout.dp, coords["dp"]
        self.cp_size, self.cp_rank = self.layout.cp, coords["cp"]
        self.ep_size, self.ep_rank = self.layout.ep, coords["ep"]
        self.expert_dp_size, self.expert_dp_rank = self.layout.expert_dp, coords["expert-dp"]
        self.dp_shard_size, self.dp_shard_rank = self.layout.dp_shard, coords["dp-shard"]
        self.dp_replicate_size = self.layout.dp_replicate
        self.dp_replicate_rank = coords["dp-replicate"]
        self.context_group = self._groups["cp"] if self.cp_size > 1 else None

    # -- torch DeviceMesh ------------------------------------------------------------------
    def to_device_mesh(self, device_type: str | None = None, *, dense: bool = False):
        """A torch ``DeviceMesh`` of this layout whose dims' process groups ARE this mesh's
        (nothing is created): dims "pp", "dp", "tp" in the order's reverse (slowest first:
        ``("pp", "dp", "tp")`` for "tp-ep-dp-pp"); with ep > 1 (unless ``dense``) the expert
        grid "pp", "edp", "ep", "tp" (dp = edp × ep). ``device_type`` defaults to "cuda" under
        NCCL, else "cpu". See ``fastpar.mesh.bridge``."""
        return bridge.to_device_mesh(self, device_type, dense=dense)

    @classmethod
    def from_device_mesh(
        cls, device_mesh: DeviceMesh, *, timeout: timedelta | float | None = None
    ) -> ParallelMesh:
        """The ParallelMesh of a torch ``DeviceMesh`` over the whole world (say
        ``init_device_mesh("cuda", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``), its
        dims named among "pp", "dp", "edp", "ep", "tp" in any order (the order string is the
        dims from fastest to slowest). The groups along the DeviceMesh's dims are used as this
        mesh's groups of those kinds (they keep their own timeouts); the other kinds (mp,
        tp-dp, embedding, ...) are created with ``timeout`` as in ``ParallelMesh(...)``.
        Collective: every rank must call it."""
        kwargs, provided = bridge.layout_of_device_mesh(device_mesh)
        return cls(**kwargs, timeout=timeout, _provided=provided)

    # -- groups -------------------------------------------------------------------------
    def group(self, kind: str) -> dist.ProcessGroup | None:
        """The process group of ``kind`` holding this rank (None for "embedding" off the ends)."""
        if kind not in self._groups:
            raise KeyError(f"unknown group kind {kind!r}; kinds are {list(GROUP_KINDS)}")
        return self._groups[kind]

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind`` ([] if it is in none)."""
        if kind not in self._ranks:
            raise KeyError(f"unknown group kind {kind!r}; kinds are {list(GROUP_KINDS)}")
        return list(self._ranks[kind])

    tp_group = property(lambda self: self._groups["tp"])
    pp_group = property(lambda self: self._groups["pp"])
    dp_group = property(lambda self: self._groups["dp"])
    mp_group = property(lambda self: self._groups["mp"])
    tp_dp_group = property(lambda self: self._groups["tp-dp"])
    cp_group = property(lambda self: self._groups["cp"])
    dp_cp_group = property(lambda self: self._groups["dp-cp"])
    tp_cp_group = property(lambda self: self._groups["tp-cp"])
    dp_shard_group = property(lambda self: self._groups["dp-shard"])
    dp_replicate_group = property(lambda self: self._groups["dp-replicate"])
    dp_shard_cp_group = property(lambda self: self._groups["dp-shard-cp"])
    expert_dp_shard_group = property(lambda self: self._groups["expert-dp-shard"])
    expert_dp_replicate_group = property(lambda self: self._groups["expert-dp-replicate"])
    ep_group = property(lambda self: self._groups["ep"])
    expert_dp_group = property(lambda self: self._groups["expert-dp"])
    tp_ep_group = property(lambda self: self._groups["tp-ep"])
    embedding_group = property(lambda self: self._groups["embedding"])

    # -- pipeline neighbours ------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self._ranks["pp"][self.pp_rank + 1]

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self._ranks["pp"][self.pp_rank - 1]

    def __repr__(self) -> str:
        hybrid = ""
        if self.layout.hybrid:
            hybrid = (
                f", dp_shard={self.dp_shard_rank}/{self.dp_shard_size}, "
                f"dp_replicate={self.dp_replicate_rank}/{self.dp_replicate_size}"
            )
        return (
            f"ParallelMesh(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size}{hybrid}, "
            f"ep={self.ep_rank}/{self.ep_size}, order={self.layout.order!r})"
        )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _check_dp(dp: int | None, world_size: int, other: int) -> None:
    """The world holds tp*cp*pp x dp ranks where dp is given (ValueError naming both)."""
    if dp is not None and world_size != other * dp:
        raise ValueError(
            f"dp {dp} needs a world of tp*cp*pp x dp = {other} x {dp} = {other * dp} ranks, "
            f"but WORLD_SIZE is {world_size}; start {other * dp} ranks or change dp (or "
            f"dp_shard x dp_replicate)"
        )


def init(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    *,
    cp: int = 1,
    order: str = DEFAULT_ORDER,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    dp_shard: int | None = None,
    dp_replicate: int | None = None,
    dp: int | None = None,
) -> ParallelMesh:
    """Initialise torch.distributed from torchrun's environment and build the mesh.

    Reads RANK, WORLD_SIZE (and MASTER_ADDR / MASTER_PORT) as torchrun sets them; without them
    it starts a one-rank world, so a script runs unchanged on a laptop. The layout is checked
    before any process group exists. ``backend`` defaults to NCCL where CUDA is available, else
    gloo; with NCCL the CUDA device is set from LOCAL_RANK. Every collective of the default
    group and of every mesh group times out after ``timeout`` (a timedelta or seconds; default
    ``fastpar.mesh.DEFAULT_TIMEOUT``, 10 minutes) instead of hanging. If torch.distributed is
    already initialised, only the mesh's groups take ``timeout`` (default: the default group's).
    ``dp_shard`` / ``dp_replicate``: hybrid sharding of dp (``ParallelMesh``; default: all of
    dp shards). ``dp``: the data-parallel size, checked against the world size (default: the
    world size / (tp*cp*pp)); any two of ``dp``, ``dp_shard``, ``dp_replicate`` give the third.
    """
    dp, dp_shard, dp_replicate = resolve_dp(dp, dp_shard, dp_replicate)
    hybrid = dict(dp_shard=dp_shard, dp_replicate=dp_replicate)
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; install a build with it")
    if dist.is_initialized():
        _check_dp(dp, dist.get_world_size(), tp * cp * pp)
        return ParallelMesh(tp, pp, ep, order=order, timeout=timeout, cp=cp, **hybrid)
    timeout = as_timeout(DEFAULT_TIMEOUT if timeout is None else timeout)
    world_size = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    if (world_size is None) != (rank is None):
        raise RuntimeError(
            "RANK and WORLD_SIZE must be set together (torchrun sets both); got "
            f"RANK={os.environ.get('RANK')!r}, WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}"
        )
    need = max(tp * pp * ep * cp, tp * cp * pp * (dp or 1))
    if world_size is not None:
        _check_dp(dp, world_size, tp * cp * pp)
    if world_size is None and need > 1:
        raise RuntimeError(
            f"fastpar.init(tp={tp}, pp={pp}, ep={ep}, cp={cp}) needs {need} or more ranks, but "
            "this is one process with no RANK / WORLD_SIZE: start the script with torchrun "
            f"(torchrun --nproc-per-node {need} script.py), or run a function on ranks of "
            f"this machine with fastpar.launch.run_ranks(fn, {need})"
        )
    MeshLayout(  # refuse a bad layout early
        world_size or 1, tp=tp, pp=pp, ep=ep, order=order, cp=cp, **hybrid
    )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)
    torch_buffer()  # FASTPAR_FLIGHT=0: torch's flight recorder off too
    if world_size is None:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return ParallelMesh(tp, pp, ep, order=order, timeout=timeout, cp=cp, **hybrid)
