"""``PipelineEngine``: run a schedule's steps for this rank's stage (or model chunks).

    stage, _ = build_stage(blocks, mesh.pp_size, mesh.pp_rank)
    engine = PipelineEngine(stage, mesh, OneFOneB(8), loss_fn=F.cross_entropy)
    loss = engine.train_step(inputs, targets)    # inputs on the first stage, targets on the last

Micro-batching, loss normalisation, recompute, data-parallel stages, tied parameters, MoE aux
losses, tuple messages, ``context``, interleaved and zero-bubble schedules, evaluation:
docs/pipelines.md ("Inside the engine")."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fastpar.comm import plain
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_duplicated
from fastpar.mesh.ranks import global_rank
from fastpar.parallel.data.protocols import DataParallel, GradSync
from fastpar.parallel.pipeline.p2p import P2P
from fastpar.parallel.pipeline.partition import VirtualStages
from fastpar.parallel.pipeline.protocols import aux_loss_hooks, aux_loss_weighed
from fastpar.parallel.pipeline.runner import StepRunner
from fastpar.parallel.pipeline.schedules import Schedule


def tie_across_stages(param: torch.Tensor, mesh: ParallelMesh) -> None:
    """Declare ``param`` shared by the first and last stage (held on both): mark it duplicated
    over the embedding group (``fastpar.mesh.placement``: the grad norm counts it once, on the
    group's first rank) and copy that first rank's value — the first stage's — to the last.
    Call on both stages, in the same order."""
    group = mesh.embedding_group
    if mesh.pp_size == 1 or group is None:
        return
    mark_duplicated(param, group)
    with torch.no_grad():
        plain.broadcast(param.data, src=global_rank(group, 0), group=group)


def _chunks_of(stage: nn.Module | Sequence[nn.Module], v: int) -> list:
    """The v modules the engine runs: the stage itself when v == 1, else its chunks."""
    if v == 1 and isinstance(stage, nn.Module) and not isinstance(stage, nn.ModuleList):
        return [stage]
    inner = stage.module if isinstance(stage, DataParallel) else stage  # a wrapped stage
    if isinstance(stage, list | tuple | nn.ModuleList):
        chunks = list(stage)
    elif isinstance(inner, VirtualStages):
        if inner is not stage and _gathers(stage):
            raise ValueError(
                "an interleaved schedule with a ZeRO-3 wrapper: its gathers run around the "
                "wrapper's forward, which model chunks bypass; use ZeRO 0, 1 or 2"
            )
        chunks = list(inner.chunks)
    else:
        chunks = [stage]
    if len(chunks) != v:
        raise ValueError(
            f"the schedule runs {v} model chunks per rank but the stage holds {len(chunks)}; "
            "build the stage with build_virtual_stages(..., virtual_stages) for the same v"
        )
    return chunks


class PipelineEngine(StepRunner):
    """Executes ``schedule`` for ``stage`` (this rank's blocks, or its model chunks for an
    interleaved schedule) over the mesh's pipeline group.

    ``loss_fn(output, target)`` is needed on the last stage. ``scale_loss`` (e.g. a mixed-precision
    optimizer's) multiplies each micro-batch loss before its backward. ``grad_sync``: the
    data-parallel wrapper whose gradients the backward passes fill (default: the stage, when it
    is one); ``no_sync``: a context for all micro-batches but the last (default: the
    wrapper's). ``moe_aux_loss``: weigh the stage's auxiliary losses (its MoE layers',
    ``protocols.AuxLoss``) like a micro-batch's loss. ``static_shapes``: whether
    activation shapes are the same for every micro-batch (agreed once). Statistics of the last
    step are in ``stats``: busy (forwards and backwards), send (posting sends and early
    receives), recv (in receives, mostly waiting for a peer) and wall seconds, the
    ``time.perf_counter()`` at which this rank's actions began and ended, peak
    micro-batches in flight, and peak bytes of
    stored activations (stage inputs; plus the tensors autograd saves when
    ``measure_activations`` — a Python hook per saved tensor, so off by default).
    """

    def __init__(
        self,
        stage: nn.Module | Sequence[nn.Module],
        mesh: ParallelMesh,
        schedule: Schedule,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        recompute: bool = False,
        static_shapes: bool = True,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        tied: Sequence[torch.Tensor] = (),
        measure_activations: bool = False,
        grad_sync: GradSync | None = None,
        moe_aux_loss: bool = True,
        normalization: str = "sequence",
        ignore_index: int = -100,
    ) -> None:
        if normalization not in ("sequence", "token"):
            raise ValueError(f"normalization must be 'sequence' or 'token', got {normalization!r}")
        if mesh.is_last_stage and loss_fn is None:
            raise ValueError("the last pipeline stage needs loss_fn(output, target)")
        if not schedule.has_backward:
            raise ValueError(
                f"{type(schedule).__name__} has no backward: give the engine a training "
                "schedule and call eval_step (it runs the schedule's forward_only())"
            )
        schedule.check(mesh.pp_size)
        if schedule.splits_backward:
            _check_split(stage, grad_sync, recompute)
        v = schedule.virtual_stages
        self.chunks = _chunks_of(stage, v)
        if grad_sync is None and isinstance(stage, GradSync):
            grad_sync = stage
        if no_sync is None and grad_sync is not None:
            no_sync = grad_sync.no_sync
        self.stage, self.mesh, self.schedule = stage, mesh, schedule
        self.loss_fn, self.recompute, self.no_sync = loss_fn, recompute, no_sync
        self.grad_sync, self.moe_aux_loss = grad_sync, moe_aux_loss
        self._aux_hooks: list | None = None  # (protocols.aux_loss_hooks)
        self.scale_loss, self.tied = scale_loss, list(tied)
        self.measure_activations = measure_activations
        self.normalization, self.ignore_index = normalization, ignore_index
        self._token_weight: torch.Tensor | None = None  # token: dp·cp / the global count
        self._context: Callable | None = None
        self._mb = 0  # the micro-batch whose action runs (for ``context``)
        prev, nxt = mesh.prev_rank, mesh.next_rank
        if v > 1:  # the last rank's chunk c feeds rank 0's chunk c + 1: the ring closes
            ring, r, p = mesh.ranks("pp"), mesh.pp_rank, mesh.pp_size
            prev, nxt = ring[(r - 1) % p], ring[(r + 1) % p]
        self.p2p = P2P(prev, nxt, static_shapes=static_shapes)
        self._eval_p2p = P2P(prev, nxt, static_shapes=static_shapes)
        self.stats: dict[str, float] = {}
        self._grad_flags: dict[int, list[bool]] = {}  # per chunk, tuple outputs under recompute

    def _device(self) -> torch.device:
        params = (p for c in self.chunks for p in c.parameters())
        return next(params, torch.empty(0)).device

    def _split(self, inputs, targets, m: int):
        mesh = self.mesh
        if mesh.is_first_stage and inputs is None:
            raise ValueError("the first pipeline stage needs the inputs")
        if mesh.is_last_stage and targets is None:
            raise ValueError("the last pipeline stage needs the targets")
        xs = None if inputs is None else _microbatches(inputs, m, "inputs")
        ys = None if targets is None else _microbatches(targets, m, "targets")
        return xs, ys

    def train_step(
        self,
        inputs: torch.Tensor | tuple | None = None,
        targets: torch.Tensor | tuple | None = None,
        *,
        broadcast_loss: bool = True,
        valid_tokens: int | torch.Tensor | None = None,
        context: Callable | None = None,
    ) -> torch.Tensor | None:
        """One mini-batch: forwards and backwards per the schedule; gradients accumulate in the
        parameters' ``.grad``. Returns the mini-batch loss (a 0-dim tensor; on every stage with
        ``broadcast_loss``, else only on the last). ``valid_tokens``: under "token"
        normalisation, the global batch's count of valid targets (None: counted, one
        all-reduce); ``context``: see the module docstring."""
        mesh = self.mesh
        xs, ys = self._split(inputs, targets, self.schedule.num_microbatches)
        device = self._device()
        self._prepare(ys, device, valid_tokens, context)
        saved: dict[tuple[int, int], dict] = {}
        losses: list[torch.Tensor] = []
        t_step = time.perf_counter()
        self.p2p.send_s = self.p2p.recv_s = 0.0
        actions = self.schedule.actions(mesh.pp_size, mesh.pp_rank)
        if self._aux_hooks is None:  # the chunks' MoE layers, found on the first step only
            self._aux_hooks = aux_loss_hooks(self.chunks)
        aux = aux_loss_weighed(
            self._aux_hooks, self._aux_scale(device) if self.moe_aux_loss else None
        )
        with aux:
            t_actions = time.perf_counter()
            busy, peak = self._run_steps(actions, xs, ys, device, saved, losses)
            t_done = time.perf_counter()
        self.p2p.wait_sends()
        if self.grad_sync is not None:  # e.g. DDP's tied-embedding sum, every stage done
            self.grad_sync.finish_grad_sync()
        self._sync_tied()
        self.stats = {
            "busy_s": busy,
            "send_s": self.p2p.send_s,
            "recv_s": self.p2p.recv_s,
            "wall_s": time.perf_counter() - t_step,
            "actions_s": (t_actions, t_done),
            "peak_activation_bytes": peak,
            "max_in_flight": self.schedule.max_in_flight(mesh.pp_size, mesh.pp_rank),
        }
        return self._loss(losses, device, broadcast_loss)

    @torch.no_grad()
    def eval_step(
        self,
        inputs: torch.Tensor | tuple | None = None,
        targets: torch.Tensor | tuple | None = None,
        *,
        broadcast_loss: bool = True,
        valid_tokens: int | torch.Tensor | None = None,
        context: Callable | None = None,
    ) -> torch.Tensor | None:
        """The mini-batch's loss without backward: the schedule's ``forward_only()`` (the same
        micro-batches and chunks), the modules in eval mode (restored after), no graph and no
        gradient touched. Returns the mean loss (0-dim; on every stage with ``broadcast_loss``,
        else only on the last)."""
        mesh, sched = self.mesh, self.schedule.forward_only()
        xs, ys = self._split(inputs, targets, sched.num_microbatches)
        device = self._device()
        self._prepare(ys, device, valid_tokens, context)
        modes = [(mod, mod.training) for c in self.chunks for mod in c.modules()]
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        try:
            for mod, _ in modes:
                mod.training = False
            actions = sched.actions(mesh.pp_size, mesh.pp_rank)
            busy, _ = self._run_steps(
                actions, xs, ys, device, {}, losses, p2p=self._eval_p2p, train=False
            )
            self._eval_p2p.wait_sends()
        finally:
            for mod, mode in modes:
                mod.training = mode
        self.eval_stats = {"busy_s": busy, "wall_s": time.perf_counter() - t0}
        return self._loss(losses, device, broadcast_loss)

    def _prepare(self, ys, device, valid_tokens, context) -> None:
        """The step's context and, under "token" normalisation, the weight of a micro-batch's
        loss sum: dp·cp / the global count of valid targets (at least 1)."""
        self._context, self._token_weight = context, None
        if self.normalization != "token" or not self.mesh.is_last_stage:
            return
        mesh = self.mesh
        replicas = mesh.dp_size * mesh.cp_size
        if valid_tokens is None:
            targets = (y[0] if isinstance(y, tuple | list) else y for y in ys)  # a tuple's first
            count = sum((t != self.ignore_index).sum() for t in targets)
            count = torch.as_tensor(count, device=device).to(torch.float64)
            if replicas > 1:  # on the device: no host sync
                plain.all_reduce(count, group=mesh.dp_cp_group)
        else:
            count = torch.as_tensor(valid_tokens, dtype=torch.float64).to(device)
        self._token_weight = replicas / count.clamp(min=1)

    def _loss(self, losses, device, broadcast_loss: bool):
        mesh = self.mesh
        loss = torch.stack(losses).sum() if mesh.is_last_stage else None
        if broadcast_loss and mesh.pp_size > 1:
            buf = loss.clone() if mesh.is_last_stage else torch.zeros((), device=device)
            plain.broadcast(buf, src=mesh.ranks("pp")[-1], group=mesh.pp_group)
            loss = buf
        return loss

    def _aux_scale(self, device: torch.device) -> torch.Tensor:
        """The weight of one micro-batch's loss in backward: ``scale_loss(1) / m`` (0-dim fp32,
        on the device: no host sync)."""
        one = torch.ones((), dtype=torch.float32, device=device)
        scaled = self.scale_loss(one) if self.scale_loss is not None else one
        return torch.div(scaled.float(), self.schedule.num_microbatches)

    def _sync_tied(self) -> None:
        mesh = self.mesh
        if not self.tied or mesh.pp_size == 1 or mesh.embedding_group is None:
            return
        for p in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            plain.all_reduce(p.grad, group=mesh.embedding_group)


def _check_split(stage, grad_sync, recompute: bool) -> None:  # recompute: B recomputes first
    """What a split backward (zero bubble) cannot run with: one-line errors naming the fix."""
    for w in (stage, grad_sync):
        if _gathers(w):
            raise ValueError(
                "zb-h1 with ZeRO-3: its parameter gathers follow one backward per forward, which "
                "the B/W split breaks; use ZeRO 0, 1 or 2, or --schedule 1f1b"
            )


def _gathers(wrapper) -> bool:
    """Whether ``wrapper`` is a data-parallel wrapper that gathers its parameters around its
    own forward and backward (ZeRO-3: its ``stage``)."""
    return isinstance(wrapper, DataParallel) and wrapper.stage == 3


def _microbatches(batch, m: int, name: str) -> list:
    """``batch`` (a tensor or a tuple of tensors) split into ``m`` micro-batches along dim 0."""
    parts = batch if isinstance(batch, tuple | list) else (batch,)
    for t in parts:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a tensor or a tuple of tensors, got {type(t).__name__}"
            )
        if t.dim() == 0 or t.shape[0] % m:
            raise ValueError(
                f"{name} hold {t.shape[0] if t.dim() else 'no'} samples, not divisible into {m} micro-batches; use a "
                f"batch size that is a multiple of {m} or another number of micro-batches"
            )
    if not isinstance(batch, tuple | list):
        return list(batch.chunk(m))
    return list(zip(*(t.chunk(m) for t in batch), strict=True))
