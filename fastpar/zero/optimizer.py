"""``ZeroOptimizer``: ZeRO stages 1 and 2 over flat, padded buckets.

    opt = ZeroOptimizer(FusedAdamW(model.parameters(), lr=3e-4), stage=2, mesh=mesh,
                        scaler=DynamicLossScaler(), max_grad_norm=1.0)
    opt.scale_loss(loss).backward()      # buckets reduce-scatter during backward
    skipped, grad_norm = opt.step()      # update this rank's shard, all-gather the parameters
    opt.zero_grad()

Layout: parameters are packed into buckets (see ``fastpar.parallel.buckets``) whose flat size is
padded to a multiple of the DP size N; the model's parameters become views into one flat
parameter buffer per bucket, and DP rank r owns elements [r·S, (r+1)·S) of each, S = size / N.
For its shards a rank holds the fp32 master copy (for fp32 parameters, the shard of the
parameter buffer itself) and the optimizer state (stage 1 and 2) and the reduced gradient (fp32,
shard-sized; at stage 1 with fp32 gradients, the rank's own slice of the full gradient buffer).
Stage 1 reduces once per step: accumulate micro-batches inside ``no_sync()``. Stage 1 also keeps full-size gradient buffers (the
parameters' ``.grad`` are views into them); stage 2 does not: each bucket's gradient lives only
from its first gradient until its reduce-scatter completes during backward (at most two buckets
in flight), so gradient accumulation (several backward passes before ``step``) reduce-scatters
every backward and sums the shards.

Step: unscale + inf check + sum of squares over the shard in one fused pass (each element of a
DP-sharded gradient is counted by exactly one rank; TP duplicates by the parameter marks), one
all-reduce of [found_inf, sumsq] over every rank taking part, the scaler update, clipping, the
wrapped optimizer's step on the fp32 master shards (skipped on the device for optimizers that
take a ``found_inf``, else one host sync), then an all-gather of the updated parameters.

Use it instead of ``DistributedDataParallel`` (it does the gradient reduction itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from fastpar.amp.norm import counts_on_this_rank
from fastpar.amp.scaler import ConstantLossScaler, DynamicLossScaler
from fastpar.amp.step import OptimizerFront, guarded_step, unscale_and_agree
from fastpar.mesh.placement import data_parallel_groups, duplicated_over, is_expert
from fastpar.mesh.ranks import global_rank, group_rank, group_size
from fastpar.optim.pieces import keys_for, state_pieces
from fastpar.parallel.buckets import Bucket, BucketReducer, build_buckets, payload_bytes


class ZeroOptimizer(OptimizerFront):
    """ZeRO-1/2 around ``optimizer`` (built on the model's parameters, before any step).

    ``stage``: 1 shards optimizer state and masters; 2 also shards gradients. ``mesh`` / ``group``:
    the DP group is ``mesh.dp_group`` (or ``group``, None = the default group); with a mesh the
    norm and the overflow flag are agreed over the whole world and parameters are counted by
    their TP marks; without one, the DP group is the whole job. ``reduce_dtype`` (default fp32):
    dtype of the reduce-scatter for low-precision gradients. ``check_gradients=False`` (only
    without scaler and clipping) skips the per-step inf check and global norm — one pass over the
    shards and one small all-reduce — and step() then returns a NaN norm. Parameters are
    broadcast from the first DP rank when wrapped.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int = 1,
        mesh=None,
        group: dist.ProcessGroup | None = None,
        bucket_size_mb: float = 25.0,
        scaler: DynamicLossScaler | ConstantLossScaler | None = None,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        check_gradients: bool = True,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (ZeRO-3 is fastpar.zero.Zero3), got {stage!r}")
        if optimizer.state:
            raise ValueError("wrap the optimizer before its first step (it already holds state)")
        if mesh is not None and group is not None:
            raise ValueError("pass either mesh= or group=, not both")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        self.optimizer, self.stage, self.mesh = optimizer, stage, mesh
        self.scaler, self.max_grad_norm, self.reduce_dtype = scaler, max_grad_norm, reduce_dtype
        if not check_gradients and (scaler is not None or max_grad_norm is not None):
            raise ValueError("check_gradients=False needs scaler=None and max_grad_norm=None")
        self.check_gradients = check_gradients
        # expert parameters (fastpar.nn.MoE) are sharded over the expert-data-parallel group,
        # everything else over the DP group: one bucket list per (param group, kind)
        dense_group, expert_group = data_parallel_groups(mesh, group)
        self.group = dense_group
        self.dp_size, self.dp_rank = group_size(self.group), group_rank(self.group)
        self.comm_bytes = 0.0
        kinds = [(self.group, self.dp_size, self.dp_rank)]
        kinds.append((expert_group, group_size(expert_group), group_rank(expert_group)))
        groups, self._meta, self._dup_groups = [], [], {}
        for gi, g in enumerate(optimizer.param_groups):
            for kind, (comm_group, size, rank) in enumerate(kinds):
                mine = [p for p in g["params"] if is_expert(p) == bool(kind)]
                groups.append([p for p in mine if not duplicated_over(p)])
                self._meta.append((gi, comm_group, size, rank))
                # a parameter held on several pipeline stages (a tied embedding) gets a bucket of
                # its own: the same flat layout on every holder, so their shards can be summed
                for p in mine:
                    if duplicated_over(p):
                        self._dup_groups[len(groups)] = duplicated_over(p)
                        groups.append([p])
                        self._meta.append((gi, comm_group, size, rank))
        params = [p for g in groups for p in g]
        with torch.no_grad():
            for g, (_, comm_group, size, _) in zip(groups, self._meta, strict=True):
                if size > 1:
                    for p in g:
                        dist.broadcast(p.data, src=global_rank(comm_group, 0), group=comm_group)
        self.buckets = build_buckets(groups, bucket_size_mb, pad_to=[m[2] for m in self._meta])
        self.shard_size: dict[int, int] = {}
        self.param_buf: dict[int, torch.Tensor] = {}
        self.grad_buf: dict[int, torch.Tensor | None] = {}
        self.shard_grad: dict[int, torch.Tensor] = {}
        self.masters: dict[int, torch.nn.Parameter] = {}
        self._finished: set[int] = set()
        self._shard_in_gbuf: set[int] = set()  # stage 1, fp32: shard_grad is a view of grad_buf
        self._holds_reduced: set[int] = set()
        counted_views: list[tuple[torch.Tensor, bool]] = []
        for b in self.buckets:
            device = b.params[0].device
            _, _, size, rank = self._meta[b.group_index]
            s = b.padded_numel // size
            lo = rank * s
            pbuf = torch.zeros(b.padded_numel, dtype=b.dtype, device=device)
            with torch.no_grad():
                for i, p in enumerate(b.params):
                    view = b.view(pbuf, i)
                    view.copy_(p.data)
                    p.data = view
            self.param_buf[b.index] = pbuf
            self.shard_size[b.index] = s
            self.shard_grad[b.index] = torch.zeros(s, dtype=torch.float32, device=device)
            if b.dtype == torch.float32:  # the fp32 shard of the parameter buffer is the master
                master = torch.nn.Parameter(pbuf[lo : lo + s])
            else:
                master = torch.nn.Parameter(pbuf[lo : lo + s].detach().float().clone())
            master.grad = self.shard_grad[b.index]
            self.masters[b.index] = master
            self.grad_buf[b.index] = None
            if stage == 1:
                gbuf = torch.zeros(b.padded_numel, dtype=b.dtype, device=device)
                self.grad_buf[b.index] = gbuf
                for i, p in enumerate(b.params):
                    p.grad = b.view(gbuf, i)
                if b.dtype == torch.float32 and reduce_dtype in (None, torch.float32):
                    # the reduced fp32 shard lives in this rank's slice of the full buffer: no
                    # second copy (ZeroRedundancyOptimizer's footprint)
                    self.shard_grad[b.index] = gbuf[lo : lo + s]
                    master.grad = self.shard_grad[b.index]
                    self._shard_in_gbuf.add(b.index)
            for i, p in enumerate(b.params):  # this rank's piece of each parameter, for the norm
                a, z = max(b.offsets[i], lo), min(b.offsets[i] + p.numel(), lo + s)
                if a < z:
                    counted = (
                        True
                        if mesh is None
                        else counts_on_this_rank(p, mesh=mesh, dp_replicated=False)
                    )
                    counted_views.append((self.shard_grad[b.index][a - lo : z - lo], counted))
        self._counted = [v for v, c in counted_views if c]
        self._uncounted = [v for v, c in counted_views if not c]
        for gi, g in enumerate(optimizer.param_groups):
            g["params"] = [
                self.masters[b.index] for b in self.buckets if self._meta[b.group_index][0] == gi
            ]
        device = params[0].device if params else torch.device("cpu")
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        names = {id(p): f"param {i}" for i, p in enumerate(params)}
        self.reducer = BucketReducer(
            self.buckets,
            launch=self._launch,
            finish=self._finish,
            grad_target=self._grad_target,
            names=names,
        )

    # -- gradients --------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate into the full gradient buffers without communicating. Stage 2
        keeps no full buffers, so every backward reduce-scatters; this is then a no-op."""
        if self.stage == 1:
            with self.reducer.no_sync():
                yield
        else:
            yield

    def _grad_target(self, b: Bucket, i: int, p: torch.nn.Parameter | None) -> None:
        gbuf = self.grad_buf[b.index]
        if gbuf is None:  # stage 2: the bucket's buffer lives until its reduce-scatter ends
            gbuf = self.grad_buf[b.index] = torch.zeros(
                b.padded_numel, dtype=b.dtype, device=self.param_buf[b.index].device
            )
        view = b.view(gbuf, i)
        param = b.params[i]
        if p is None:  # no gradient this backward
            if self.stage == 2 or param.grad is None or param.grad.data_ptr() != view.data_ptr():
                view.zero_()
            return
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view if self.stage == 1 else None

    def _launch(self, b: Bucket):
        if b.index in self._holds_reduced:
            raise RuntimeError(
                "ZeroOptimizer(stage=1): a second backward reached the gradient reduction before "
                "zero_grad(); accumulate micro-batches inside opt.no_sync() (the last one outside "
                "it), then step() and zero_grad()"
            )
        self._finished.discard(b.index)
        if self.stage == 2:  # bound the live full-size buffers: finish the bucket before last
            prev = self.buckets[b.index - 2] if b.index >= 2 else None
            if prev is not None and prev.launched and prev.index not in self._finished:
                if prev.work is not None:
                    prev.work.wait()
                self._finish(prev)
        gbuf = self.grad_buf[b.index]
        rd = self.reduce_dtype
        comm = gbuf.to(rd) if rd is not None and rd != gbuf.dtype else gbuf
        out = torch.empty(self.shard_size[b.index], dtype=comm.dtype, device=comm.device)
        b.comm = (comm, out)
        _, group, size, _ = self._meta[b.group_index]
        if size == 1:
            out.copy_(comm)
            return None
        self.comm_bytes += payload_bytes("reduce_scatter", comm.numel(), comm.element_size(), size)
        return dist.reduce_scatter_tensor(out, comm, group=group, async_op=True)

    def _finish(self, b: Bucket) -> None:
        if b.index in self._finished:
            return
        self._finished.add(b.index)
        _, out = b.comm
        # averaged over the dense DP group (expert gradients already sum their EP group's tokens)
        b.comm = None
        if b.index in self._shard_in_gbuf:  # the shard is a slice of the buffer being reset
            reduced = out.float().div_(self.dp_size)
            self.grad_buf[b.index].zero_()
            self.shard_grad[b.index].copy_(reduced)
            self._holds_reduced.add(b.index)
            return
        self.shard_grad[b.index].add_(out.float(), alpha=1.0 / self.dp_size)
        if self.stage == 2:
            self.grad_buf[b.index] = None
        else:  # reduced into the shard: the next backward starts the full buffer from zero
            self.grad_buf[b.index].zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the shard gradients (and stage 1's full buffers; ``set_to_none`` is ignored:
        the buffers are reused)."""
        self._holds_reduced.clear()
        for b in self.buckets:
            self.shard_grad[b.index].zero_()
            gbuf = self.grad_buf[b.index]
            if self.stage == 1:
                gbuf.zero_()  # in case a backward under no_sync left something behind
                for i, p in enumerate(b.params):
                    p.grad = b.view(gbuf, i)
            else:
                for p in b.params:
                    p.grad = None

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (skipped: 0-dim bool tensor, grad_norm: 0-dim fp32 tensor before clipping)."""
        self.reducer.wait_all()
        for b in self.buckets:  # tied copies: every holder adds the others' gradient shards
            for g in self._dup_groups.get(b.group_index, ()):
                dist.all_reduce(self.shard_grad[b.index], group=g)
        group = self.group if self.mesh is None else None
        if self.check_gradients:
            found, norm = unscale_and_agree(
                [(self._counted, None, True), (self._uncounted, None, False)],
                self.scaler, self._skipped.device, mesh=self.mesh, group=group,
            )  # fmt: skip
        else:  # no scaler, no clipping, no inf check: no extra pass, no extra collective
            found = torch.zeros((), device=self._skipped.device)
            norm = torch.full((), float("nan"), device=self._skipped.device)
        for b in self.buckets:
            self.masters[b.index].grad = self.shard_grad[b.index]
        skipped = guarded_step(
            self.optimizer, list(self.shard_grad.values()), found, norm,
            scaler=self.scaler, max_grad_norm=self.max_grad_norm, skipped_counter=self._skipped,
        )  # fmt: skip
        self._all_gather_params()
        return skipped, norm

    def _all_gather_params(self) -> None:
        works = []
        for b in self.buckets:
            pbuf = self.param_buf[b.index]
            _, group, size, _ = self._meta[b.group_index]
            master = self.masters[b.index].detach()
            if self._aliases(b):
                if size == 1:
                    continue
                local = master.clone()  # the collective's input must not alias its output
            else:
                local = master.to(pbuf.dtype)
                if size == 1:
                    pbuf.copy_(local)
                    continue
            self.comm_bytes += payload_bytes("all_gather", pbuf.numel(), pbuf.element_size(), size)
            works.append(dist.all_gather_into_tensor(pbuf, local, group=group, async_op=True))
        for w in works:
            w.wait()

    def _aliases(self, b: Bucket) -> bool:
        m = self.masters[b.index]
        return (
            m.untyped_storage().data_ptr() == self.param_buf[b.index].untyped_storage().data_ptr()
        )

    # -- state ------------------------------------------------------------------------------
    def layout_signature(self) -> list:
        return [
            (str(b.dtype), b.group_index, b.padded_numel, [p.numel() for p in b.params])
            for b in self.buckets
        ]

    def state_dict(self) -> dict:
        """This rank's shard: masters, the wrapped optimizer's state, the scaler, the layout."""
        return {
            "stage": self.stage,
            "dp_size": self.dp_size,
            "dp_rank": self.dp_rank,
            "layout": self.layout_signature(),
            "masters": [self.masters[b.index].detach().clone() for b in self.buckets],
            "optimizer": self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "skipped_steps": self._skipped.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume on the same layout (same DP size and rank, same buckets); parameters are
        rebuilt from the loaded masters."""
        mine = (self.dp_size, self.dp_rank, self.layout_signature())
        theirs = (state["dp_size"], state["dp_rank"], state["layout"])
        if mine != theirs:
            raise ValueError(
                f"this ZeRO state was saved by DP rank {state['dp_rank']} of {state['dp_size']} "
                f"with another bucket layout; it loads only into the same layout (this is rank "
                f"{self.dp_rank} of {self.dp_size}). Reshard through a full checkpoint instead"
            )
        with torch.no_grad():
            for b, saved in zip(self.buckets, state["masters"], strict=True):
                self.masters[b.index].copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._skipped.copy_(state["skipped_steps"])
        self._all_gather_params()

    # -- checkpoint protocol (fastpar.optim.pieces) -----------------------------------------
    def checkpoint_pieces(self) -> list:
        """(model param, key, values, start, stop): for each parameter with elements in this
        rank's shards, its slice [start, stop) of the fp32 master ("param"), of each
        per-element state of the wrapped optimizer, and "step" ([0, 1))."""
        out = []
        for b in self.buckets:
            s = self.shard_size[b.index]
            lo = self._meta[b.group_index][3] * s
            master = self.masters[b.index]
            state = self.optimizer.state.get(master, {})
            for i, p in enumerate(b.params):
                off = b.offsets[i]
                a, z = max(off, lo), min(off + p.numel(), lo + s)
                if a >= z:
                    continue
                out.append((p, "param", master.detach()[a - lo : z - lo], a - off, z - off))
                out += state_pieces(p, state, master.shape, slice(a - lo, z - lo), a - off)
        return out

    def load_checkpoint_pieces(self, lookup) -> None:
        """Rebuild every parameter buffer, the fp32 master shards and the wrapped optimizer's
        state from ``lookup(param, key)`` (whole local tensors, so each rank fills its full
        parameter buffers itself: no collective). A shard's "step" is its first parameter's."""
        order = [q for g in self.optimizer.param_groups for q in g["params"]]
        index = {id(q): i for i, q in enumerate(order)}
        param_groups = self.optimizer.state_dict()["param_groups"]
        state: dict[int, dict] = {}
        with torch.no_grad():
            for b in self.buckets:
                s = self.shard_size[b.index]
                lo = self._meta[b.group_index][3] * s
                master, pbuf = self.masters[b.index], self.param_buf[b.index]
                entry: dict = {}
                for i, p in enumerate(b.params):
                    off = b.offsets[i]
                    a, z = max(off, lo), min(off + p.numel(), lo + s)
                    value = lookup(p, "param")
                    if value is not None:
                        value = value.reshape(-1)
                        b.view(pbuf, i).copy_(value.view(p.shape))
                        if a < z:
                            master[a - lo : z - lo].copy_(value[a - off : z - off])
                    if a >= z:
                        continue
                    for key in keys_for(lookup, p, self.optimizer.state.get(master)):
                        t = lookup(p, key)
                        if t is None:
                            continue
                        if key == "step":
                            entry.setdefault(key, t.reshape(()).clone())
                            continue
                        if key not in entry:
                            entry[key] = torch.zeros(s, dtype=t.dtype, device=master.device)
                        entry[key][a - lo : z - lo] = t.reshape(-1)[a - off : z - off]
                if entry:
                    state[index[id(master)]] = entry
        if state:
            self.optimizer.load_state_dict({"state": state, "param_groups": param_groups})

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: params, grads (full buffers and shards),
        fp32 masters, optimizer state."""

        def nbytes(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        out = {
            "params": nbytes(self.param_buf.values()),
            "grads": nbytes(self.grad_buf.values())
            + nbytes(g for i, g in self.shard_grad.items() if i not in self._shard_in_gbuf),
            "masters": nbytes(
                m for b in self.buckets if not self._aliases(b) for m in [self.masters[b.index]]
            ),
            "optimizer": nbytes(state),
        }
        out["total"] = sum(out.values())
        return out
