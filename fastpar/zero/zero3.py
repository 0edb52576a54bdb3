"""``Zero3``: ZeRO stage 3 — parameters, gradients and optimizer state sharded over DP.

    model = Zero3(model, optimizer_factory=lambda params: FusedAdamW(params, lr=3e-4),
                  mesh=mesh, wrap=(nn.TransformerEncoderLayer,), scaler=DynamicLossScaler(),
                  max_grad_norm=1.0)
    loss = loss_fn(model(x), y)
    model.scale_loss(loss).backward()    # units gather, compute, free; grads reduce-scatter
    skipped, grad_norm = model.step()    # fused unscale/norm/clip, inner step on fp32 shards
    model.zero_grad()

Units: the wrap policy (``wrap``: module types, or ``min_params``: every submodule holding at
least that many not-yet-wrapped parameter elements, bottom up) splits the model into units;
parameters outside every wrapped module (and parameters shared between units) form the root
unit, the wrapper itself. A parameter belongs to the innermost unit containing it.

Layout: each unit's trainable parameters are packed (registration order) into flat buffers, one
per (param group, dense/expert, dtype, persistent), padded to a multiple of the size N of the
group that shards them: ``mesh.dp_group`` (or ``group``) for dense parameters, the
expert-data-parallel group for parameters marked ``fastpar.mesh.placement.mark_expert`` (their
gradients are still divided by the dense DP size, as in ``ZeroOptimizer``). DP rank r holds
elements [r·S, (r+1)·S), S = padded / N, of every flat buffer: the low-precision parameter
shard, the fp32 master shard (for fp32 parameters they are one tensor), the optimizer state and
the fp32 gradient shard. With tensor parallelism the "full" tensors are the TP-local ones
(``ColumnParallelLinear`` weights are already TP shards; ZeRO-3 shards them again over DP).

Lifetime of a unit's full parameters (all-gathered over the DP / expert-DP group):

* forward pre-hook: all-gather (wait for a prefetch if one is in flight), and issue the
  asynchronous all-gather of the next unit in the previous iteration's forward order;
* forward post-hook: the full buffer's storage is resized to 0 (the parameters keep their shape
  so autograd's saved tensors stay valid) and a hook on the unit's outputs is registered;
* when the first gradient reaches those outputs in backward: all-gather into the same storage
  again, and prefetch the unit whose backward comes next (reverse forward order);
* once every parameter of a flat buffer has its gradient (post-accumulate-grad hooks, driven by
  ``fastpar.parallel.buckets.BucketReducer``) the full gradient is reduce-scattered
  asynchronously (in ``reduce_dtype``, fp32 by default) into the fp32 gradient shard and the
  parameters are pointed at an empty tensor. Between steps ``p`` is an empty tensor; use
  ``summon_full_params()`` to see full values.

Persistent parameters (fewer than ``persist_below`` elements: biases, norms) and their optimizer
state stay replicated on every DP rank; their gradients are all-reduced (like DDP) when their
unit's gradients are ready, and every rank applies the same update. Frozen parameters
(``requires_grad=False``) stay replicated and are only broadcast. Gradient accumulation: every
backward reduce-scatters and sums into the shards (``no_sync`` is a no-op).

Step: as ``ZeroOptimizer``: one fused unscale + inf check + sum of squares over the gradient
shards (each element counted once: DP-sharded elements on their owner, persistent ones on the
first DP rank, TP duplicates by marks), one all-reduce of [found_inf, sumsq] over every rank
taking part (the world with a mesh, else the DP group), the scaler update, clipping (folded into
``FusedAdamW`` through ``clip_coef``), the inner step on the fp32 master shards (skipped on the
device through ``found_inf`` when the optimizer supports it, else one host sync), then the
masters are copied into the low-precision shards (nothing is gathered until the next forward).

Counters: ``comm_bytes`` (cumulative payload bytes this rank sent, ring model; the split is in
``comm_bytes_by``: forward / backward all-gathers, reduce-scatters, persistent all-reduces;
per step 3·Ψ_padded·(N-1)/N·bytes for sharded parameters), ``memory_bytes()`` (bytes held
between steps), ``peak_gathered_bytes`` (largest total of full parameter buffers alive at once).

Checkpoint protocol (``fastpar.checkpoint``): ``checkpoint_pieces()`` returns tuples
``(p, key, piece, start, stop)``: ``piece`` (1-D, fp32 for "param") holds elements [start, stop)
of parameter ``p``'s LOCAL (TP/EP-sharded) tensor flattened row-major, for key "param" (the fp32
master value) and every optimizer state key ("exp_avg", "exp_avg_sq", "momentum_buffer", ...;
"step" is a 1-element piece covering [0, 1)). Over the DP group the pieces of one parameter are
disjoint and cover it exactly once: persistent parameters, and "step", come from the rank that
owns the parameter's first element. ``load_checkpoint_pieces(lookup)`` copies, for every
parameter and key, the part this rank owns of ``lookup(p, key)`` (the full LOCAL tensor, or
None when absent; "step" in any one-element shape; ``lookup.keys(p)``, when present, lists the
keys to ask for) and rebuilds the low-precision shards. Between steps the model's parameters
are empty tensors: code that reads them (``fastpar.checkpoint.save`` stores fp32 parameters
from the model) must run inside ``summon_full_params()``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from fastpar.amp.norm import counts_on_this_rank
from fastpar.amp.scaler import ConstantLossScaler, DynamicLossScaler
from fastpar.amp.step import OptimizerFront, guarded_step, unscale_and_agree
from fastpar.mesh.placement import data_parallel_groups, is_expert
from fastpar.mesh.ranks import global_rank, group_rank, group_size
from fastpar.optim.pieces import KeyedLookup
from fastpar.parallel.buckets import Bucket, BucketReducer, payload_bytes

# states of a flat buffer's full parameters
_FREE = "free"  # params point at an empty tensor, full storage has 0 bytes
_RESHARDED = "resharded"  # after forward: params keep their views, full storage has 0 bytes
_GATHERING = "gathering"  # all-gather in flight
_GATHERED = "gathered"

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step")


@dataclass(eq=False)
class _Flat:
    """One flat buffer of a unit: ``bucket`` (layout), ``group`` of ``size`` ranks sharding it
    (rank ``rank``), ``sharded`` False for persistent (replicated) buffers."""

    bucket: Bucket
    unit: int
    group: dist.ProcessGroup | None
    size: int
    rank: int
    sharded: bool
    full: torch.Tensor  # [padded], low precision; storage 0 bytes while not gathered
    shard: torch.Tensor  # [S] low precision (the master itself for fp32); [padded] if persistent
    master: nn.Parameter  # [S] fp32 ([padded] if persistent)
    shard_grad: torch.Tensor  # [S] fp32 ([padded] if persistent)
    state: str = _GATHERED
    work: object = None
    grad_buf: torch.Tensor | None = None
    empties: list[torch.Tensor] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of a [padded] buffer, in the parameter's (local) shape."""
        off = self.bucket.offsets[i]
        return buffer[off : off + self.shapes[i].numel()].view(self.shapes[i])

    @property
    def lo(self) -> int:
        return self.rank * self.shard_len if self.sharded else 0

    @property
    def shard_len(self) -> int:
        return self.bucket.padded_numel // self.size if self.sharded else self.bucket.padded_numel

    @property
    def full_bytes(self) -> int:
        return self.bucket.padded_numel * self.full.element_size()


@dataclass(eq=False)
class _Unit:
    module: nn.Module
    name: str
    flats: list[_Flat] = field(default_factory=list)


def _select_units(
    module: nn.Module, wrap: Sequence[type] | None, min_params: int | None
) -> list[tuple[str, nn.Module]]:
    """Wrapped submodules (not the root), in registration order."""
    if wrap is not None and min_params is not None:
        raise ValueError("pass either wrap= (module types) or min_params=, not both")
    if wrap is not None:
        types = tuple(wrap)
        return [(n, m) for n, m in module.named_modules() if n and isinstance(m, types)]
    if min_params is None:
        return []
    if min_params < 1:
        raise ValueError(f"min_params must be >= 1, got {min_params}")
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, m: nn.Module) -> int:  # post order: unwrapped elements in the subtree
        count = sum(p.numel() for p in m.parameters(recurse=False))
        for cname, child in m.named_children():
            count += visit(f"{name}.{cname}" if name else cname, child)
        if name and count >= min_params:
            chosen.append((name, m))
            return 0
        return count

    visit("", module)
    order = {id(m): i for i, (_, m) in enumerate(module.named_modules())}
    return sorted(chosen, key=lambda nm: order[id(nm[1])])


class Zero3(OptimizerFront, nn.Module):
    """ZeRO-3 around ``module`` (see the module docstring for the layout and the schedule).

    ``optimizer_factory(params)`` builds the inner optimizer on the fp32 master shards: ``params``
    is a list of masters, or, with ``param_groups`` (a list of dicts whose "params" are model
    parameters; other keys are passed through), a list of dicts in the same order. ``mesh`` /
    ``group``: the DP group is ``mesh.dp_group`` (or ``group``, None = the default group); with
    a mesh the norm and the overflow flag are agreed over the world and parameters counted by
    their TP marks. ``wrap`` / ``min_params``: the unit policy. ``persist_below``: parameters
    with fewer elements stay replicated (gradients all-reduced). ``reduce_dtype``: dtype of the
    gradient collectives (None = the parameters' dtype). ``prefetch``: overlap the next unit's
    all-gather with the current unit's compute. Parameters and buffers are broadcast from the
    first rank of their DP (expert-DP) group when wrapped.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: Callable[[list], torch.optim.Optimizer],
        *,
        mesh=None,
        group: dist.ProcessGroup | None = None,
        wrap: Sequence[type] | None = None,
        min_params: int | None = None,
        persist_below: int = 0,
        param_groups: list[dict] | None = None,
        scaler: DynamicLossScaler | ConstantLossScaler | None = None,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        prefetch: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        if mesh is not None and group is not None:
            raise ValueError("pass either mesh= or group=, not both")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if persist_below < 0:
            raise ValueError(f"persist_below must be >= 0, got {persist_below}")
        self.module, self.mesh, self.scaler = module, mesh, scaler
        self.max_grad_norm, self.reduce_dtype, self.prefetch = max_grad_norm, reduce_dtype, prefetch
        self.group, expert_group = data_parallel_groups(mesh, group)
        self.dp_size, self.dp_rank = group_size(self.group), group_rank(self.group)
        self._kinds = [(g, group_size(g), group_rank(g)) for g in (self.group, expert_group)]
        self.comm_bytes_by = dict.fromkeys(
            ("all_gather_forward", "all_gather_backward", "reduce_scatter", "all_reduce", "summon"),
            0.0,
        )
        self.peak_gathered_bytes = 0
        self._gathered_bytes = 0

        # -- param groups, broadcast -------------------------------------------------------
        all_params = list(dict.fromkeys(module.parameters()))
        group_of: dict[int, int] = {}
        extra: list[dict] = [{}]
        if param_groups is not None:
            extra = []
            for gi, g in enumerate(param_groups):
                extra.append({k: v for k, v in g.items() if k != "params"})
                for p in g["params"]:
                    group_of[id(p)] = gi
            missing = [p for p in all_params if p.requires_grad and id(p) not in group_of]
            if missing:
                raise ValueError(
                    f"{len(missing)} trainable parameter(s) are in no entry of param_groups; "
                    "list every parameter of the model once"
                )
        with torch.no_grad():
            dense = [t for t in all_params if not is_expert(t)] + list(module.buffers())
            experts = [t for t in all_params if is_expert(t)]
            for tensors, (g, size, _) in ((dense, self._kinds[0]), (experts, self._kinds[1])):
                if size > 1:
                    for t in tensors:
                        dist.broadcast(t.data, src=global_rank(g, 0), group=g)

        # -- units and flat buffers --------------------------------------------------------
        subunits = _select_units(module, wrap, min_params)
        self.units = [_Unit(self, "<root>")] + [_Unit(m, n) for n, m in subunits]
        unit_of_module = {id(u.module): i for i, u in enumerate(self.units) if i}
        owner: dict[int, int] = {}

        def assign(m: nn.Module, unit: int) -> None:
            unit = unit_of_module.get(id(m), unit)
            for p in m.parameters(recurse=False):
                if p.requires_grad:  # shared between units: the root keeps it
                    owner[id(p)] = unit if owner.get(id(p), unit) == unit else 0
            for child in m.children():
                assign(child, unit)

        assign(module, 0)
        self._flats: list[_Flat] = []
        for ui in range(len(self.units)):
            keyed: dict[tuple, list[nn.Parameter]] = {}
            for p in all_params:
                if owner.get(id(p)) != ui:
                    continue
                key = (
                    group_of.get(id(p), 0),
                    int(is_expert(p)),
                    p.dtype,
                    p.numel() < persist_below,
                )
                keyed.setdefault(key, []).append(p)
            for (gi, kind, dtype, persistent), params in keyed.items():
                self._flats.append(self._make_flat(ui, gi, kind, dtype, persistent, params))
        # reduction order ~ backward order: units in reverse registration order, the root last
        self._flats.sort(key=lambda f: -f.unit)
        for i, f in enumerate(self._flats):
            f.bucket.index = i
            self.units[f.unit].flats.append(f)

        # -- the inner optimizer on the masters -------------------------------------------
        groups_masters: list[list[nn.Parameter]] = [[] for _ in extra]
        for f in self._flats:
            groups_masters[f.bucket.group_index >> 1].append(f.master)
        if param_groups is None:
            self.optimizer = optimizer_factory(groups_masters[0])
        else:
            self.optimizer = optimizer_factory(
                [{"params": ms, **e} for ms, e in zip(groups_masters, extra, strict=True)]
            )
        if self.optimizer.state:
            raise ValueError("optimizer_factory must return an optimizer without state")
        device = all_params[0].device if all_params else torch.device("cpu")
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

        # -- pieces of each parameter counted in the norm ---------------------------------
        counted, uncounted = [], []
        for f in self._flats:
            b, lo, s = f.bucket, f.lo, f.shard_len
            for i, p in enumerate(b.params):
                a, z = max(b.offsets[i], lo), min(b.offsets[i] + f.shapes[i].numel(), lo + s)
                if a >= z:
                    continue
                if mesh is not None:
                    c = counts_on_this_rank(p, mesh=mesh, dp_replicated=not f.sharded)
                else:
                    c = f.sharded or f.rank == 0
                (counted if c else uncounted).append(f.shard_grad[a - lo : z - lo])
        self._counted, self._uncounted = counted, uncounted

        # -- hooks ---------------------------------------------------------------------------
        names = {id(p): n for n, p in module.named_parameters()}
        self.reducer = BucketReducer(
            [f.bucket for f in self._flats],
            launch=self._launch,
            finish=self._finish,
            grad_target=self._grad_target,
            find_unused_parameters=find_unused_parameters,
            names=names,
        )
        self._handles = []
        for ui, u in enumerate(self.units[1:], start=1):
            self._handles.append(u.module.register_forward_pre_hook(self._pre_forward_hook(ui)))
            self._handles.append(u.module.register_forward_hook(self._post_forward_hook(ui)))
        self._order_prev: list[int] = list(range(len(self.units)))
        self._order: list[int] = []
        self._backward_started = False

    # -- construction -----------------------------------------------------------------------
    def _make_flat(
        self, unit: int, gi: int, kind: int, dtype: torch.dtype, persistent: bool, params: list
    ) -> _Flat:
        group, size, rank = self._kinds[kind]
        sharded = not persistent
        numel = sum(p.numel() for p in params)
        pad = size if sharded else 1
        b = Bucket(index=0, dtype=dtype, group_index=2 * gi + kind)
        for p in params:
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numel += p.numel()
        b.padded_numel = max(math.ceil(numel / pad) * pad, pad)
        device = params[0].device
        full = torch.zeros(b.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for i, p in enumerate(params):
                b.view(full, i).copy_(p.data)
        s = b.padded_numel // size if sharded else b.padded_numel
        lo = rank * s if sharded else 0
        if dtype == torch.float32:
            master = nn.Parameter(full[lo : lo + s].clone() if sharded else full)
            shard = master.data
        else:
            shard = full[lo : lo + s].clone() if sharded else full
            master = nn.Parameter(shard.detach().float().clone())
        shard_grad = torch.zeros(s, dtype=torch.float32, device=device)
        master.grad = shard_grad
        f = _Flat(b, unit, group, size, rank, sharded, full, shard, master, shard_grad)
        f.empties = [torch.empty(0, dtype=dtype, device=device) for _ in params]
        f.shapes = [p.shape for p in params]
        if sharded:
            f.state = _GATHERED
            self._gathered_bytes += f.full_bytes
            self._free(f)
        else:
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.data = f.view(full, i)
        return f

    # -- gather / free ----------------------------------------------------------------------
    def _gather_async(self, f: _Flat, kind: str) -> None:
        if not f.sharded or f.state in (_GATHERING, _GATHERED):
            return
        f.full.untyped_storage().resize_(f.full_bytes)
        self._gathered_bytes += f.full_bytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        if f.size == 1:
            with torch.no_grad():
                f.full.copy_(f.shard)
            f.work = None
        else:
            self.comm_bytes_by[kind] += payload_bytes(
                "all_gather", f.bucket.padded_numel, f.full.element_size(), f.size
            )
            f.work = dist.all_gather_into_tensor(
                f.full, f.shard.detach(), group=f.group, async_op=True
            )
        f.state = _GATHERING

    def _wait(self, f: _Flat) -> None:
        if f.state != _GATHERING:
            return
        if f.work is not None:
            f.work.wait()
            f.work = None
        with torch.no_grad():
            for i, p in enumerate(f.bucket.params):
                if p.data.data_ptr() != f.full.data_ptr() + f.bucket.offsets[i] * p.element_size():
                    p.data = f.view(f.full, i)
        f.state = _GATHERED

    def _gather_unit(self, ui: int, kind: str) -> None:
        for f in self.units[ui].flats:
            self._gather_async(f, kind)
        for f in self.units[ui].flats:
            self._wait(f)

    def _release(self, f: _Flat, keep_views: bool) -> None:
        if not f.sharded or f.state == _FREE:
            return
        if f.state == _GATHERING:
            self._wait(f)
        if f.state == _GATHERED:
            f.full.untyped_storage().resize_(0)
            self._gathered_bytes -= f.full_bytes
        if keep_views:
            f.state = _RESHARDED
            return
        with torch.no_grad():
            for p, e in zip(f.bucket.params, f.empties, strict=True):
                p.data = e
        f.state = _FREE

    def _free(self, f: _Flat) -> None:
        self._release(f, keep_views=False)

    def _prefetch(self, candidates: Sequence[int], states: tuple[str, ...], kind: str) -> None:
        """Start the all-gather of the first unit in ``candidates`` with a flat in ``states``."""
        if not self.prefetch:
            return
        for ui in candidates:
            flats = [f for f in self.units[ui].flats if f.sharded]
            if any(f.state in states for f in flats):
                for f in flats:
                    if f.state in states:
                        self._gather_async(f, kind)
                return

    # -- forward / backward hooks -------------------------------------------------------------
    def _before_forward(self, ui: int) -> None:
        if ui not in self._order:
            self._order.append(ui)
        self._gather_unit(ui, "all_gather_forward")
        order = self._order_prev
        if ui in order:
            nxt = order[order.index(ui) + 1 :]
            self._prefetch(nxt[:1], (_FREE, _RESHARDED), "all_gather_forward")

    def _after_forward(self, ui: int, output) -> None:
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        backward = torch.is_grad_enabled() and bool(tensors)
        for f in self.units[ui].flats:
            self._release(f, keep_views=backward)
        if backward:
            register_multi_grad_hook(
                tensors, lambda _g, ui=ui: self._before_backward(ui), mode="any"
            )
        elif ui == 0:  # no backward will follow (inference): drop prefetched units too
            for f in self._flats:
                self._free(f)
            self._order_prev, self._order = self._order or self._order_prev, []

    def _before_backward(self, ui: int) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._gather_unit(ui, "all_gather_backward")
        later = [u for u in reversed(self._order) if u != ui]
        self._prefetch(later, (_RESHARDED,), "all_gather_backward")

    def _end_of_backward(self) -> None:
        self._backward_started = False
        for f in self._flats:
            self._free(f)
        if self._order:
            self._order_prev, self._order = self._order, []

    def _pre_forward_hook(self, ui: int):
        def hook(_module, _args):
            self._before_forward(ui)

        return hook

    def _post_forward_hook(self, ui: int):
        def hook(_module, _args, output):
            self._after_forward(ui, output)

        return hook

    def forward(self, *args, **kwargs):
        """Run the wrapped module: the root unit is gathered around it (DP group)."""
        self._before_forward(0)
        out = self.module(*args, **kwargs)
        self._after_forward(0, out)
        return out

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Gather every unit's full parameters (collective over the DP groups: call on every
        rank) for reading, e.g. to compare or export; freed on exit. Writes are not kept."""
        for u in self.units:
            for f in u.flats:
                self._gather_async(f, "summon")
        for f in self._flats:
            self._wait(f)
        try:
            yield
        finally:
            for f in self._flats:
                self._free(f)

    # -- gradients ----------------------------------------------------------------------------
    @property
    def comm_bytes(self) -> float:
        """Payload bytes this rank sent since construction (``summon_full_params`` excluded)."""
        return sum(v for k, v in self.comm_bytes_by.items() if k != "summon")

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's fp32 gradient shards, one per flat buffer ([S], or [padded] if persistent)."""
        return [f.shard_grad for f in self._flats]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A no-op: ZeRO-3 keeps no full gradients, so every backward reduce-scatters and the
        shards accumulate (gradient accumulation works without it)."""
        yield

    def _grad_target(self, b: Bucket, i: int, p: nn.Parameter | None) -> None:
        f = self._flats[b.index]
        if f.grad_buf is None:
            f.grad_buf = torch.zeros(b.padded_numel, dtype=b.dtype, device=f.shard_grad.device)
        view = f.view(f.grad_buf, i)
        if p is None:
            view.zero_()
            return
        view.copy_(p.grad)
        p.grad = None
        if len(b.ready) + 1 >= len(b.params):  # the last of this buffer's gradients
            self._free(f)

    def _launch(self, b: Bucket):
        f = self._flats[b.index]
        if b.index >= 2:  # bound the live full-size gradient buffers, as ZeRO-2 does
            prev = self.reducer.buckets[b.index - 2]
            if prev.launched and prev.comm is not None:
                if prev.work is not None:
                    prev.work.wait()
                    prev.work = None
                self._finish(prev)
        rd = self.reduce_dtype
        gbuf = f.grad_buf
        comm = gbuf.to(rd) if rd is not None and rd != gbuf.dtype else gbuf
        if not f.sharded:
            b.comm = (comm, comm)
            if f.size == 1:
                return None
            self.comm_bytes_by["all_reduce"] += payload_bytes(
                "all_reduce", comm.numel(), comm.element_size(), f.size
            )
            return dist.all_reduce(comm, group=f.group, async_op=True)
        out = torch.empty(f.shard_len, dtype=comm.dtype, device=comm.device)
        b.comm = (comm, out)
        if f.size == 1:
            out.copy_(comm)
            return None
        self.comm_bytes_by["reduce_scatter"] += payload_bytes(
            "reduce_scatter", comm.numel(), comm.element_size(), f.size
        )
        return dist.reduce_scatter_tensor(out, comm, group=f.group, async_op=True)

    def _finish(self, b: Bucket) -> None:
        if b.comm is None:
            return
        f = self._flats[b.index]
        _, out = b.comm
        # averaged over the dense DP group (expert gradients already sum their EP group's tokens)
        f.shard_grad.add_(out.float(), alpha=1.0 / self.dp_size)
        b.comm = None
        f.grad_buf = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (``set_to_none`` is ignored: the shards are reused)."""
        for f in self._flats:
            f.shard_grad.zero_()
            for p in f.bucket.params:
                p.grad = None

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (skipped: 0-dim bool tensor, grad_norm: 0-dim fp32 tensor before clipping).
        Communicates one 2-element all-reduce (world with a mesh, else the DP group)."""
        self.reducer.wait_all()
        group = self.group if self.mesh is None else None
        found, norm = unscale_and_agree(
            [(self._counted, None, True), (self._uncounted, None, False)],
            self.scaler, self._skipped.device, mesh=self.mesh, group=group,
        )  # fmt: skip
        for f in self._flats:
            f.master.grad = f.shard_grad
        skipped = guarded_step(
            self.optimizer, [f.shard_grad for f in self._flats], found, norm,
            scaler=self.scaler, max_grad_norm=self.max_grad_norm, skipped_counter=self._skipped,
        )  # fmt: skip
        self._masters_to_shards()
        return skipped, norm

    @torch.no_grad()
    def _masters_to_shards(self) -> None:
        """Copy the fp32 masters into the low-precision shards (persistent: full buffers)."""
        for f in self._flats:
            if f.shard.untyped_storage().data_ptr() != f.master.untyped_storage().data_ptr():
                f.shard.copy_(f.master.detach())

    # -- state --------------------------------------------------------------------------------
    def layout_signature(self) -> list:
        return [
            (f.unit, str(f.bucket.dtype), f.bucket.group_index, f.sharded, f.bucket.padded_numel,
             [tuple(shape) for shape in f.shapes])
            for f in self._flats
        ]  # fmt: skip

    def state_dict(self) -> dict:
        """This rank's shard: masters, the inner optimizer's state, the scaler, the layout."""
        return {
            "stage": 3,
            "dp_size": self.dp_size,
            "dp_rank": self.dp_rank,
            "layout": self.layout_signature(),
            "masters": [f.master.detach().clone() for f in self._flats],
            "optimizer": self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "skipped_steps": self._skipped.clone(),
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:  # type: ignore[override]
        """Resume on the same layout (same DP size and rank, same units); the low-precision
        shards are rebuilt from the loaded masters. ``strict`` is accepted for nn.Module
        compatibility; the layout must match regardless."""
        mine = (3, self.dp_size, self.dp_rank, self.layout_signature())
        theirs = (state.get("stage"), state["dp_size"], state["dp_rank"], state["layout"])
        if mine != theirs:
            raise ValueError(
                f"this ZeRO-3 state was saved by DP rank {state['dp_rank']} of "
                f"{state['dp_size']} with another unit layout; it loads only into the same layout "
                f"(this is rank {self.dp_rank} of {self.dp_size}). Reshard through a full "
                "checkpoint (checkpoint_pieces) instead"
            )
        with torch.no_grad():
            for f, saved in zip(self._flats, state["masters"], strict=True):
                f.master.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._skipped.copy_(state["skipped_steps"])
        self._masters_to_shards()

    def _owned(self) -> Iterator[tuple[_Flat, int, int, int, bool]]:
        """(flat, i, a, z, first): this rank holds elements [a, z) of the flat's parameter i
        (flattened), ``first`` when it owns element 0 (persistent: the first rank of its group)."""
        for f in self._flats:
            b, lo, s = f.bucket, f.lo, f.shard_len
            if not f.sharded and f.rank != 0:
                continue
            for i, shape in enumerate(f.shapes):
                off = b.offsets[i]
                a, z = max(off, lo), min(off + shape.numel(), lo + s)
                if a < z:
                    yield f, i, a - off, z - off, lo <= off < lo + s

    def checkpoint_pieces(self) -> list[tuple[nn.Parameter, str, torch.Tensor, int, int]]:
        """(p, key, piece, start, stop) for every parameter piece this rank owns (see the module
        docstring); pieces are views of the live shards (copy them before the next step)."""
        out = []
        for f, i, a, z, first in self._owned():
            p, lo, off = f.bucket.params[i], f.lo, f.bucket.offsets[i]
            sl = slice(off + a - lo, off + z - lo)
            out.append((p, "param", f.master.detach()[sl], a, z))
            for key, v in self.optimizer.state.get(f.master, {}).items():
                if not torch.is_tensor(v):
                    continue
                if v.numel() == f.master.numel() and v.dim() > 0:
                    out.append((p, key, v[sl], a, z))
                elif v.numel() == 1 and first:
                    out.append((p, key, v.reshape(1), 0, 1))
        return out

    @torch.no_grad()
    def load_checkpoint_pieces(
        self, lookup: Callable[[nn.Parameter, str], torch.Tensor | None]
    ) -> None:
        """Copy this rank's part of ``lookup(p, key)`` (p's full LOCAL tensor, or None) into the
        masters and the optimizer state (state tensors are created when missing), then rebuild
        the low-precision shards. Local; no communication."""
        for f in self._flats:
            b, lo, s = f.bucket, f.lo, f.shard_len
            state = self.optimizer.state[f.master]
            keyed = isinstance(lookup, KeyedLookup)  # it lists the keys saved
            for i, p in enumerate(b.params):
                off, numel = b.offsets[i], f.shapes[i].numel()
                a, z = max(off, lo), min(off + numel, lo + s)
                keys = ["param", *state.keys(), *_STATE_KEYS]
                if keyed:
                    keys = ["param", *lookup.keys(p)]
                for key in dict.fromkeys(keys):
                    t = lookup(p, key)
                    if t is None:
                        continue
                    t = t.detach().reshape(-1)
                    scalar = key == "step" or (key in state and state[key].dim() == 0)
                    if key != "param" and scalar:
                        if key not in state:
                            state[key] = torch.zeros((), dtype=torch.float32, device=p.device)
                        state[key].copy_(t.reshape(state[key].shape))
                        continue
                    if t.numel() != numel:
                        raise ValueError(
                            f"lookup returned {t.numel()} elements for {key!r} of a parameter "
                            f"of local shape {tuple(f.shapes[i])} ({numel} elements)"
                        )
                    if a >= z:
                        continue
                    if key == "param":
                        dst = f.master.detach()
                    else:
                        if key not in state:
                            state[key] = torch.zeros_like(f.master.detach())
                        dst = state[key]
                    dst[a - lo : z - lo].copy_(t[a - off : z - off])
            if not state:
                del self.optimizer.state[f.master]
        self._masters_to_shards()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameter shards (and persistent parameters),
        gradient shards, fp32 masters (when separate from the parameters), optimizer state.
        Full buffers gathered during forward/backward are reported by ``peak_gathered_bytes``."""

        def nbytes(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        aliased = {
            id(f)
            for f in self._flats
            if f.shard.untyped_storage().data_ptr() == f.master.untyped_storage().data_ptr()
        }
        out = {
            "params": nbytes(f.shard for f in self._flats),
            "grads": nbytes(f.shard_grad for f in self._flats)
            + nbytes(f.grad_buf for f in self._flats),
            "masters": nbytes(f.master for f in self._flats if id(f) not in aliased),
            "optimizer": nbytes(state),
        }
        out["total"] = sum(out.values())
        return out

    def flat_numels(self, sharded: bool = True) -> list[int]:
        """Unpadded element counts of the (sharded or persistent) flat buffers, for
        ``fastpar.zero.estimate_memory(..., bucket_numels=...)``."""
        return [f.bucket.numel for f in self._flats if f.sharded == sharded]

    def padded_numel(self, sharded: bool = True) -> int:
        """Ψ_padded: elements of the (sharded or persistent) flat buffers, padding included."""
        return sum(f.bucket.padded_numel for f in self._flats if f.sharded == sharded)
