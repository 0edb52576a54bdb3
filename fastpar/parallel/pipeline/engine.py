"""``PipelineEngine``: run a schedule's steps for this rank's stage.

    stage, _ = build_stage(blocks, mesh.pp_size, mesh.pp_rank)
    engine = PipelineEngine(stage, mesh, OneFOneB(8), loss_fn=F.cross_entropy)
    loss = engine.train_step(inputs, targets)    # inputs on the first stage, targets on the last
    optimizer.step()

The mini-batch is split into m micro-batches along dim 0; each micro-batch's loss is divided by
m, so the accumulated gradients and the returned loss equal the unpipelined model's for a
loss that averages over the batch. With ``recompute=True`` a forward runs without keeping its
graph (only the stage input is stored) and is recomputed, under the same RNG state, right
before its backward. A data-parallel stage (``fastpar.parallel.GradSync``: ``Replicate``,
``Shard``, ``DistributedDataParallel``, or ``grad_sync=`` for one that is not the stage, e.g. a
``ZeroOptimizer``) reduces its gradients once, in the last micro-batch's backward (the others
run inside its ``no_sync()``; an explicit ``no_sync`` callable overrides), and its
``finish_grad_sync()`` runs after the last backward of every micro-batch. ``tied`` parameters
(a word embedding on the first stage and the LM head on the last) have their ``.grad`` summed
over the mesh's embedding group after the last backward, so both copies take identical steps —
for plain optimizers; fastpar's data-parallel wrappers sum parameters marked by
``tie_across_stages`` themselves (where their gradients live), so pass no ``tied`` with them.

Mixture of experts: around every forward (and recomputation) the engine sets the weight of one
micro-batch's loss, ``scale_loss(1) / micro-batches``, as ``fastpar.moe.layer.aux_loss_scale``:
each ``fastpar.moe.MoE`` of the stage then adds its auxiliary loss to backward with the weight
of the main loss (``moe_aux_loss=False``: left to the caller).

Stage messages: a stage may return a tensor or a tuple of tensors (None allowed; integer and
bool tensors too), e.g. hidden states with rotary cos / sin, position ids and a mask — the next
stage receives the same tuple. In backward, gradients flow back only for the floating slots
that required grad on the sending stage; the other slots get none and nothing is sent for them.
The first stage's ``inputs`` may be a tuple too (each tensor split into micro-batches along
dim 0). Under ``recompute`` the forward runs without grad, so which output slots will require
grad is learnt once per engine: its first tuple-producing forward runs a second time with grad
enabled (output and graph dropped at once, the RNG left as the first run left it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fastpar.mesh.placement import mark_duplicated
from fastpar.mesh.ranks import global_rank
from fastpar.moe.layer import aux_loss_scale
from fastpar.parallel.pipeline.p2p import P2P, tuple_message
from fastpar.parallel.pipeline.schedules import Schedule
from fastpar.parallel.protocols import GradSync
from fastpar.profiling import nvtx


def tie_across_stages(param: torch.Tensor, mesh) -> None:
    """Declare ``param`` shared by the first and last stage (held on both): mark it duplicated
    over the embedding group (``fastpar.mesh.placement``: the grad norm counts it once, on the
    group's first rank) and copy that first rank's value — the first stage's — to the last.
    Call on both stages, in the same order."""
    group = mesh.embedding_group
    if mesh.pp_size == 1 or group is None:
        return
    mark_duplicated(param, group)
    with torch.no_grad():
        dist.broadcast(param.data, src=global_rank(group, 0), group=group)


class PipelineEngine:
    """Executes ``schedule`` for ``stage`` (this rank's blocks) over the mesh's pipeline group.

    ``loss_fn(output, target)`` is needed on the last stage. ``scale_loss`` (e.g. a mixed-precision
    optimizer's) multiplies each micro-batch loss before its backward. ``grad_sync``: the
    data-parallel wrapper whose gradients the backward passes fill (default: the stage, when it
    is one); ``no_sync``: a context for all micro-batches but the last (default: the
    wrapper's). ``moe_aux_loss``: weigh MoE auxiliary losses like a micro-batch's loss (module
    docstring). ``static_shapes``: whether
    activation shapes are the same for every micro-batch (agreed once). Statistics of the last
    step are in ``stats``: busy and wall seconds, peak micro-batches in flight, and peak bytes of
    stored activations (stage inputs; plus the tensors autograd saves when
    ``measure_activations`` — a Python hook per saved tensor, so off by default).
    """

    def __init__(
        self,
        stage: nn.Module,
        mesh,
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
    ) -> None:
        if mesh.is_last_stage and loss_fn is None:
            raise ValueError("the last pipeline stage needs loss_fn(output, target)")
        if grad_sync is None and isinstance(stage, GradSync):
            grad_sync = stage
        if no_sync is None and grad_sync is not None:
            no_sync = grad_sync.no_sync
        self.stage, self.mesh, self.schedule = stage, mesh, schedule
        self.loss_fn, self.recompute, self.no_sync = loss_fn, recompute, no_sync
        self.grad_sync, self.moe_aux_loss = grad_sync, moe_aux_loss
        self.scale_loss, self.tied = scale_loss, list(tied)
        self.measure_activations = measure_activations
        self.p2p = P2P(mesh.prev_rank, mesh.next_rank, static_shapes=static_shapes)
        self.stats: dict[str, float] = {}
        self._grad_flags: list[bool] | None = None  # tuple outputs under recompute, learnt once

    def train_step(
        self,
        inputs: torch.Tensor | tuple | None = None,
        targets: torch.Tensor | tuple | None = None,
        *,
        broadcast_loss: bool = True,
    ) -> torch.Tensor | None:
        """One mini-batch: forwards and backwards per the schedule; gradients accumulate in the
        parameters' ``.grad``. Returns the mini-batch loss (a 0-dim tensor; on every stage with
        ``broadcast_loss``, else only on the last)."""
        mesh, m = self.mesh, self.schedule.num_microbatches
        first, last = mesh.is_first_stage, mesh.is_last_stage
        if first and inputs is None:
            raise ValueError("the first pipeline stage needs the inputs")
        if last and targets is None:
            raise ValueError("the last pipeline stage needs the targets")
        xs = None if inputs is None else _microbatches(inputs, m, "inputs")
        ys = None if targets is None else _microbatches(targets, m, "targets")
        device = next(iter(self.stage.parameters()), torch.empty(0)).device
        saved: dict[int, dict] = {}
        losses: list[torch.Tensor] = []
        t_step = time.perf_counter()
        steps = self.schedule.steps(mesh.pp_size, mesh.pp_rank)
        last_backward = max(i for kind, i in steps if kind == "B")
        moe = aux_loss_scale(self._aux_scale(device) if self.moe_aux_loss else None)
        with moe:
            busy, peak = self._run_steps(steps, xs, ys, device, saved, losses, last_backward)
        self.p2p.wait_sends()
        if self.grad_sync is not None:  # e.g. DDP's tied-embedding sum, every stage done
            self.grad_sync.finish_grad_sync()
        self._sync_tied()
        self.stats = {
            "busy_s": busy,
            "wall_s": time.perf_counter() - t_step,
            "peak_activation_bytes": peak,
            "max_in_flight": self.schedule.max_in_flight(mesh.pp_size, mesh.pp_rank),
        }
        loss = torch.stack(losses).sum() if last else None
        if broadcast_loss and mesh.pp_size > 1:
            buf = loss.clone() if last else torch.zeros((), device=device)
            dist.broadcast(buf, src=mesh.ranks("pp")[-1], group=mesh.pp_group)
            loss = buf
        return loss

    def _aux_scale(self, device: torch.device) -> torch.Tensor:
        """The weight of one micro-batch's loss in backward: ``scale_loss(1) / m`` (0-dim fp32,
        on the device: no host sync)."""
        one = torch.ones((), dtype=torch.float32, device=device)
        scaled = self.scale_loss(one) if self.scale_loss is not None else one
        return torch.div(scaled.float(), self.schedule.num_microbatches)

    def _run_steps(self, steps, xs, ys, device, saved, losses, last_backward) -> tuple:
        """The schedule's forwards and backwards; returns (busy seconds, peak stored bytes)."""
        mesh = self.mesh
        first, last = mesh.is_first_stage, mesh.is_last_stage
        live = peak = 0
        busy = 0.0
        for kind, i in steps:
            if kind == "F":
                x = xs[i] if first else self.p2p.recv(mesh.prev_rank, device)
                t0 = time.perf_counter()
                if not first and isinstance(x, torch.Tensor) and x.is_floating_point():
                    x.requires_grad_(True)  # (tuple slots arrive flagged by their sender)
                entry, nbytes = {"x": x}, _nbytes(x)
                if self.recompute:  # the recomputed forward replays this RNG state
                    entry["rng"] = _get_rng(device)
                with nvtx(f"stage{mesh.pp_rank} forward mb{i}"):
                    if self.recompute:
                        with torch.no_grad():
                            out = self._run(x, ys[i] if last else None)
                        if (
                            not last
                            and not isinstance(out, torch.Tensor)
                            and self._grad_flags is None
                        ):
                            self._grad_flags = self._learn_grad_flags(x, device)
                    elif self.measure_activations:
                        out, graph_bytes = self._run_counting(x, ys[i] if last else None)
                        entry["out"] = out
                        nbytes += graph_bytes
                    else:
                        entry["out"] = out = self._run(x, ys[i] if last else None)
                entry["bytes"] = nbytes
                saved[i] = entry
                live += nbytes
                peak = max(peak, live)
                busy += time.perf_counter() - t0
                if last:
                    losses.append(out.detach())
                elif isinstance(out, torch.Tensor):
                    self.p2p.send(out, mesh.next_rank)
                else:
                    out = tuple_message(out)
                    flags = self._grad_flags if self.recompute else _requires_grad(out)
                    entry["slots"] = [j for j, f in enumerate(flags) if f]
                    self.p2p.send(out, mesh.next_rank, requires_grad=flags)
            else:
                entry = saved.pop(i)
                slots = entry.get("slots")  # None: a single-tensor output
                grad = None
                if not last and (slots is None or slots):
                    grad = self.p2p.recv(mesh.next_rank, device)
                t0 = time.perf_counter()
                sync = i == last_backward or self.no_sync is None
                no_sync = contextlib.nullcontext() if sync else self.no_sync()
                with nvtx(f"stage{mesh.pp_rank} backward mb{i}"), no_sync:
                    if self.recompute:
                        rng = _get_rng(device)
                        _set_rng(entry["rng"])
                        with torch.enable_grad():
                            out = self._run(entry["x"], ys[i] if last else None)
                        _set_rng(rng)
                    else:
                        out = entry["out"]
                    if last:
                        loss = self.scale_loss(out) if self.scale_loss is not None else out
                        loss.backward()
                    elif slots is None:
                        torch.autograd.backward(out, grad)
                    elif slots:
                        torch.autograd.backward(_grad_outputs(out, slots), list(grad))
                busy += time.perf_counter() - t0
                live -= entry["bytes"]
                if not first:
                    self._send_input_grad(entry["x"])
        return busy, peak

    def _run(self, x, target):
        out = self.stage(x)
        if target is not None:
            out = self.loss_fn(out, target) / self.schedule.num_microbatches
        return out

    def _send_input_grad(self, x) -> None:
        """The gradient of this stage's input, to the previous stage: of the tensor if it
        requires grad, or of each tuple slot that does (zeros for one the stage did not use)."""
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                self.p2p.send(x.grad, self.mesh.prev_rank)
        elif wanted := [t for t in x if t is not None and t.requires_grad]:
            grads = tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in wanted)
            self.p2p.send(grads, self.mesh.prev_rank)

    def _learn_grad_flags(self, x, device: torch.device) -> list[bool]:
        """Which slots of this stage's tuple output require grad: the forward of ``x`` once
        more with grad enabled, its output and graph dropped, the RNG left as it was."""
        rng = _get_rng(device)
        with torch.enable_grad():
            flags = _requires_grad(tuple_message(self.stage(x)))
        _set_rng(rng)
        return flags

    def _run_counting(self, x, target) -> tuple[torch.Tensor, int]:
        """Forward keeping the graph; also the bytes autograd saved for backward."""
        counted = [0]

        def pack(t):
            counted[0] += _nbytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self._run(x, target)
        return out, counted[0]

    def _sync_tied(self) -> None:
        mesh = self.mesh
        if not self.tied or mesh.pp_size == 1 or mesh.embedding_group is None:
            return
        for p in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=mesh.embedding_group)


def _get_rng(device: torch.device) -> tuple:
    """The RNG state a forward draws from: the CPU generator's, and the device's on a GPU."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), device, cuda


def _set_rng(state: tuple) -> None:
    cpu, device, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _nbytes(t) -> int:
    if isinstance(t, tuple | list):
        return sum(_nbytes(u) for u in t if u is not None)
    return t.numel() * t.element_size()


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


def _requires_grad(msg: tuple) -> list[bool]:
    return [t is not None and t.requires_grad for t in msg]


def _grad_outputs(out: tuple, slots: list[int]) -> list[torch.Tensor]:
    """The output slots that receive a gradient; each must require grad (a recomputed forward
    must produce what the first one announced)."""
    lost = [j for j in slots if not (isinstance(out[j], torch.Tensor) and out[j].requires_grad)]
    if lost:
        raise RuntimeError(
            f"stage output slots {lost} required grad when first sent but not in this backward "
            "(the stage's output changed between its forward and its recomputation); a stage "
            "must return the same kinds of tensors for every micro-batch"
        )
    return [out[j] for j in slots]
