"""``FlatDataParallel``: what every member of the data-parallel family does over ``FlatShard``
objects; ``Replicate`` (stage 0) and ``Shard`` (ZeRO 1, 2, 3) only choose where a flat's tensors
live. The stages' table, expert and tied parameters, and the step: docs/layouts.md ("The
data-parallel family")."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fastpar.amp.step import OptimizerFront, guarded_step, unscale_and_agree
from fastpar.comm import plain
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import data_parallel_groups, is_expert, sharding_groups
from fastpar.mesh.ranks import global_rank, group_rank, group_size
from fastpar.parallel.data import layout
from fastpar.parallel.data import state as _state
from fastpar.parallel.data.buckets import Bucket, BucketReducer, payload_bytes
from fastpar.parallel.data.flat import FlatShard
from fastpar.parallel.data.units import Units

COUNTERS = (
    "all_gather_forward",
    "all_gather_backward",
    "reduce_scatter",
    "all_reduce",
    "all_gather",
    "tied",
    "summon",
    "replicate_all_reduce",
)
"""Keys of ``comm_bytes_by``: ZeRO-3's gathers in forward and backward, reductions, the
all-gather after a ZeRO-1/2 step, the sums of tied parameters, ``summon_full_params``, and
hybrid sharding's all-reduce of the reduced shards over the replicas. Under hybrid sharding
the gathers and the reduce-scatter go over the shard group (docs/layouts.md, "Hybrid
sharding": the formula per group)."""

MakeOptimizer = Callable[[list[list[nn.Parameter]]], torch.optim.Optimizer]


class FlatDataParallel(OptimizerFront):
    """The family's behaviour (docs/layouts.md); ``Replicate`` and ``Shard`` construct it."""

    stage: int
    module: nn.Module | None

    # -- construction -------------------------------------------------------------------------
    def _setup(
        self,
        module: nn.Module | None,
        groups: list[list[nn.Parameter]],
        make_optimizer: MakeOptimizer | None,
        *,
        stage: int,
        mesh: ParallelMesh | None = None,
        group: dist.ProcessGroup | None = None,
        bucket_size_mb: float | None = 25.0,
        reduce_dtype: torch.dtype | None = torch.float32,
        scaler=None,
        max_grad_norm: float | None = None,
        find_unused_parameters: bool = False,
        check_gradients: bool = True,
        broadcast_parameters: bool = True,
        units: Units | None = None,
        persist_below: int = 0,
    ) -> None:
        if mesh is not None and group is not None:
            raise ValueError("pass either mesh= or group=, not both")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if not check_gradients and (scaler is not None or max_grad_norm is not None):
            raise ValueError("check_gradients=False needs scaler=None and max_grad_norm=None")
        if persist_below < 0:
            raise ValueError(f"persist_below must be >= 0, got {persist_below}")
        self.stage, self.mesh, self.scaler = stage, mesh, scaler
        self.max_grad_norm, self.reduce_dtype = max_grad_norm, reduce_dtype
        self.check_gradients = check_gradients
        dense_group, expert_group = data_parallel_groups(mesh, group)
        self.group = dense_group
        self.dp_size, self.dp_rank = group_size(dense_group), group_rank(dense_group)
        # (group, size, rank) that replicated flats reduce over, sharded flats shard over
        # (hybrid sharding: the shard groups), and the groups of the shards' replicas
        self._full = [(g, group_size(g), group_rank(g)) for g in (dense_group, expert_group)]
        shards, self._replicas = sharding_groups(mesh, group)
        self._kinds = [(g, group_size(g), group_rank(g)) for g in shards]
        self.comm_bytes_by = dict.fromkeys(COUNTERS, 0.0)
        self._units = units
        params = list(dict.fromkeys(p for g in groups for p in g))
        if module is not None:
            params = list(dict.fromkeys([*module.parameters(), *params]))
        if broadcast_parameters:
            buffers = list(module.buffers()) if module is not None else []
            self._broadcast(params, buffers)
        self.flats = layout.plan_flats(self, groups, params, bucket_size_mb, units, persist_below)
        for f in self.flats:
            layout.allocate(self, f, optimizer=make_optimizer is not None)
            if f.master is not None:  # which flat a master is a shard of (fastpar.optim.Muon)
                f.master._fastpar_flat = f
        device = params[0].device if params else torch.device("cpu")
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.optimizer = None
        if make_optimizer is not None:
            by_group: list[list[nn.Parameter]] = [[] for _ in groups]
            for f in self.flats:
                by_group[f.param_group].append(f.master)
            self.optimizer = make_optimizer(by_group)
            if self.optimizer.state:
                raise ValueError("the optimizer must be built without state (before any step)")
        self._passes = layout.norm_passes(self)
        if units is not None:
            units.attach(self.flats)
        names = {}
        if module is not None:
            names = {id(p): n for n, p in module.named_parameters()}
        self.reducer = BucketReducer(
            [f.bucket for f in self.flats],
            launch=self._launch,
            finish=self._finish,
            grad_target=self._grad_target,
            find_unused_parameters=find_unused_parameters,
            names=names or {id(p): f"param {i}" for i, p in enumerate(params)},
            bound=2 if stage >= 2 else None,
        )

    def _broadcast(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """Every tensor from the first rank of the group that replicates it (experts: the
        expert-DP group), so all replicas start equal."""
        dense = [p for p in params if not is_expert(p)] + buffers
        experts = [p for p in params if is_expert(p)]
        with torch.no_grad():
            for tensors, (g, size, _) in zip((dense, experts), self._full, strict=True):
                if size > 1:
                    for t in tensors:
                        plain.broadcast(t.data, src=global_rank(g, 0), group=g)

    # -- gradients ------------------------------------------------------------------------------
    @property
    def defers_reduction_in_no_sync(self) -> bool:
        """Whether backward passes inside ``no_sync()`` leave the reduction to a later one
        (stages 0, 1), so that one may run as several engine calls (ZB-H1's prompt W);
        stages 2 and 3 reduce at the end of every backward."""
        return self.stage <= 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate without communicating (stages 0, 1); the first
        backward outside reduces everything. Stages 2 and 3 keep no full-size gradients and
        reduce every backward anyway (their shards accumulate): there it changes nothing."""
        if self.stage <= 1:
            with self.reducer.no_sync():
                yield
        else:
            yield

    def _grad_target(self, b: Bucket, i: int, p: nn.Parameter | None) -> None:
        f = self.flats[b.index]
        f.dirty = True
        if f.grad is None:  # stages 2, 3: the full gradient lives until its reduction ends
            f.grad = torch.zeros(f.padded, dtype=f.dtype, device=f.params[0].device)
        view = f.grad_views[i] if f.grad_persistent else f.view(f.grad, i)
        param = f.params[i]
        if p is None:  # no gradient this backward: it counts as zero (keeps what no_sync added)
            kept = param.grad is not None and param.grad.data_ptr() == view.data_ptr()
            if not (f.grad_persistent and kept):
                view.zero_()
            if f.grad_persistent:
                param.grad = view
            return
        if p.grad is not view and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)  # a fresh tensor (stages 2, 3; or .grad set to None)
        if not f.grad_persistent:
            p.grad = None
        elif p.grad is not view:
            p.grad = view
        if self._units is not None and f.sharded and len(b.ready) + 1 >= len(b.params):
            self._units.free(f)  # the last of its gradients: the full parameters are done

    def _launch(self, b: Bucket):
        f = self.flats[b.index]
        if f.holds_reduced:
            raise RuntimeError(
                "ZeRO-1: a second backward reached the gradient reduction before zero_grad(); "
                "accumulate micro-batches inside opt.no_sync() (the wrapper's; the last one "
                "outside it), then step() and zero_grad()"
            )
        buf, rd = f.grad, self.reduce_dtype
        if f.in_place and f.size == 1:  # e.g. experts when EP = DP: still the DP average
            if self.dp_size > 1:
                buf.div_(self.dp_size)
            return None
        comm = buf.to(rd) if rd is not None and rd != buf.dtype else buf
        b.comm = comm
        if f.in_place:
            comm.div_(self.dp_size)
            return f.all_reduce(comm)
        return f.reduce(comm)

    def _finish(self, b: Bucket) -> None:
        f, comm = self.flats[b.index], b.comm
        b.comm = None
        if f.in_place:
            f.tied_pending = bool(f.tied)
            if comm is not None and comm is not f.grad:
                f.grad.copy_(comm)
            return
        out = comm[f.mine]
        if f.reduced_in_grad:  # out is this rank's range of grad itself
            out.div_(self.dp_size)
            f.grad[: f.lo].zero_()
            f.grad[f.lo + f.shard_len :].zero_()
            f.holds_reduced, f.dirty = True, False
            return
        f.reduced.add_(out, alpha=1.0 / self.dp_size)
        if f.grad_persistent:
            f.grad.zero_()
            f.dirty = False
        else:
            f.grad = None

    def finish_grad_sync(self) -> None:
        """Wait for every reduction in flight (backward's end does so itself); at stage 0 also
        sum the gradients of parameters held on several pipeline stages over their holders
        (the ``.grad`` a caller's optimizer reads). Once every stage is done with backward: the
        pipeline engine calls it after its last backward. The ZeRO stages sum their tied
        gradient shards in ``step()``, once, however many backward passes came before."""
        self.reducer.wait_all()
        for f in self.flats:
            if f.in_place and f.tied_pending:  # once per reduction, as it reached .grad
                self._sum_tied(f, f.grad)
                f.tied_pending = False

    def _sum_tied(self, f: FlatShard, t: torch.Tensor) -> None:
        for g in f.tied:
            self.comm_bytes_by["tied"] += payload_bytes(
                "all_reduce", t.numel(), t.element_size(), group_size(g)
            )
            plain.all_reduce(t, group=g)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward accumulates from zero, at every stage. Gradients live in this wrapper's
        buffers, reused in place. ``set_to_none`` (default): between steps every ``.grad`` is None,
        and the next backward's first gradient of each parameter is copied into its view (no pass
        zeroing the buffer, as torch's DDP does with ``gradient_as_bucket_view``); False: at stages
        0 and 1 each ``.grad`` is its zeroed view (stages 2, 3 keep no full gradients: None)."""
        for f in self.flats:
            f.holds_reduced = False
            if f.reduced is not None and not f.in_place:
                f.reduced.zero_()
            if f.grad_persistent and set_to_none:  # each view is overwritten before it is read
                for p in f.params:
                    p.grad = None
                f.dirty = True  # stale until then: a later zero_grad(False) clears it
            elif f.grad_persistent:
                if f.dirty:
                    f.grad.zero_()
                f.dirty = False
                for p, v in zip(f.params, f.grad_views, strict=True):
                    if p.grad is not v:
                        p.grad = v
            else:
                f.grad = None
                for p in f.params:
                    p.grad = None

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step (docs/layouts.md). Returns (skipped: 0-dim bool tensor,
        grad_norm: 0-dim fp32 tensor before clipping), both on the device: no host sync."""
        if self.optimizer is None:
            raise RuntimeError(
                "this wrapper synchronises gradients only (no optimizer_factory): step your "
                "own optimizer on the module's parameters"
            )
        self.finish_grad_sync()
        for f in self.flats:  # tied copies: every holder adds the others' gradient shards
            if f.tied and not f.in_place:
                self._sum_tied(f, f.reduced)
        device = self._skipped.device
        if self.check_gradients:
            group = self.group if self.mesh is None else None
            found, norm = unscale_and_agree(
                self._passes, self.scaler, device, mesh=self.mesh, group=group
            )
        else:  # no scaler, no clipping, no inf check: no extra pass, no extra collective
            for f in self.flats:
                if f.in_place and f.reduced is not f.grad:
                    f.reduced.copy_(f.grad)
            found = torch.zeros((), device=device)
            norm = torch.full((), float("nan"), device=device)
        for f in self.flats:
            f.master.grad = f.reduced
        skipped = guarded_step(
            self.optimizer,
            [f.reduced for f in self.flats],
            found,
            norm,
            scaler=self.scaler,
            max_grad_norm=self.max_grad_norm,
            skipped_counter=self._skipped,
        )
        self.refresh_params()
        return skipped, norm

    @torch.no_grad()
    def refresh_params(self) -> None:
        """The parameters from the fp32 masters: copied (replicated flats; ZeRO-3 shards, gathered
        at the next forward), or all-gathered over the group (ZeRO-1/2)."""
        works = []
        for f in self.flats:
            if f.master is None:
                continue
            aliased = f.aliased()
            if f.shard is not None or not f.sharded:  # a ZeRO-3 shard or a replicated flat
                if not aliased:
                    (f.full if f.shard is None else f.shard).copy_(f.master)
                continue
            if not aliased:
                f.full[f.mine].copy_(f.master)
            works.append(f.gather("all_gather"))
        for w in works:
            if w is not None:
                w.wait()

    # -- what the wrapper holds and sends -------------------------------------------------------
    @property
    def comm_bytes(self) -> float:
        """Payload bytes this rank sent since construction (ring model; ``comm_bytes_by`` has
        the split; ``summon_full_params`` excluded)."""
        return sum(v for k, v in self.comm_bytes_by.items() if k != "summon")

    @property
    def buckets(self) -> list[Bucket]:
        return [f.bucket for f in self.flats]

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's fp32 reduced gradients, one per flat ([S]; [padded] when replicated)."""
        return [f.reduced for f in self.flats]

    def grad_pieces(self) -> list[tuple[nn.Parameter, torch.Size, torch.Tensor, int, int]]:
        """(parameter, its local shape, values, start, stop): the reduced gradient this rank
        holds for the optimizer, per parameter piece (elements [start, stop) of the flattened
        local parameter), one holder per piece among the data-parallel replicas (the first);
        tied copies summed over their stages (on a copy: ``step`` sums its own). Call it after
        backward (``finish_grad_sync`` under a pipeline), before ``step``: what
        ``fastpar.checkpoint.gather_grads(..., wrapper=)`` reads. Collective over the tied
        groups. Values are scaled by the loss scale under fp16, as the optimizer sees them."""
        self.finish_grad_sync()
        out: list = []
        for f in self.flats:
            src = f.grad if f.in_place else f.reduced
            if src is None:
                continue
            if f.tied and not f.in_place:
                src = src.clone()
                for g in f.tied:
                    plain.all_reduce(src, group=g)
            if (not f.sharded and f.rank != 0) or f.replicate_rank != 0:
                continue
            for o in f.owned():
                values = src[o.shard_start : o.shard_stop].detach()
                out.append((f.params[o.index], f.shapes[o.index], values, o.start, o.stop))
        return out

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """The full parameters, readable inside the block: gathered at stage 3 (collective:
        every rank calls it), already there below."""
        if self._units is None:
            yield
        else:
            with self._units.summon():
                yield

    memory_bytes = _state.memory_bytes
    layout_signature = _state.layout_signature
    checkpoint_pieces = _state.checkpoint_pieces
    load_checkpoint_pieces = _state.load_checkpoint_pieces

    def state_dict(self, *args, **kwargs) -> dict:
        """This rank's shard: masters, the inner optimizer's state, the scaler, the layout."""
        return _state.state_dict(self)

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume on the same layout (same DP size and rank, same flats); the parameters are
        rebuilt from the loaded masters. ``strict`` is nn.Module's; the layout must match."""
        _state.load_state_dict(self, state)
