"""``PipelineEngine``: run a schedule's steps for this rank's stage.

    stage, _ = build_stage(blocks, mesh.pp_size, mesh.pp_rank)
    engine = PipelineEngine(stage, mesh, OneFOneB(8), loss_fn=F.cross_entropy)
    loss = engine.train_step(inputs, targets)    # inputs on the first stage, targets on the last
    optimizer.step()

The mini-batch is split into m micro-batches along dim 0; each micro-batch's loss is divided by
m, so the accumulated gradients and the returned loss equal the unpipelined model's for a
loss that averages over the batch. With ``recompute=True`` a forward runs without keeping its
graph (only the stage input is stored) and is recomputed, under the same RNG state, right
before its backward. With ``no_sync`` (e.g. ``ddp.no_sync``), gradients are reduced over data
parallelism once, in the last micro-batch's backward. ``tied`` parameters (a word embedding on
the first stage and the LM head on the last) have their ``.grad`` summed over the mesh's
embedding group after the last backward, so both copies take identical steps — for plain
optimizers; fastpar's DistributedDataParallel and ZeroOptimizer sum parameters marked by
``tie_across_stages`` themselves (where their gradients live), so pass no ``tied`` with them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fastpar.nn.marks import mark_duplicated
from fastpar.parallel.pipeline.p2p import P2P
from fastpar.parallel.pipeline.schedules import Schedule
from fastpar.profiling import nvtx


def tie_across_stages(param: torch.Tensor, mesh) -> None:
    """Declare ``param`` shared by the first and last stage (held on both): copy the first
    stage's value to the last, and mark it duplicated over the embedding group so the global
    grad norm counts it once. Call on both stages, in the same order."""
    if mesh.pp_size == 1 or mesh.embedding_group is None:
        return
    mark_duplicated(param, mesh.embedding_group)
    with torch.no_grad():
        dist.broadcast(param.data, src=mesh.ranks("embedding")[0], group=mesh.embedding_group)


class PipelineEngine:
    """Executes ``schedule`` for ``stage`` (this rank's blocks) over the mesh's pipeline group.

    ``loss_fn(output, target)`` is needed on the last stage. ``scale_loss`` (e.g. a mixed-precision
    optimizer's) multiplies each micro-batch loss before its backward. ``static_shapes``: whether
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
    ) -> None:
        if mesh.is_last_stage and loss_fn is None:
            raise ValueError("the last pipeline stage needs loss_fn(output, target)")
        self.stage, self.mesh, self.schedule = stage, mesh, schedule
        self.loss_fn, self.recompute, self.no_sync = loss_fn, recompute, no_sync
        self.scale_loss, self.tied = scale_loss, list(tied)
        self.measure_activations = measure_activations
        self.p2p = P2P(mesh.prev_rank, mesh.next_rank, static_shapes=static_shapes)
        self.stats: dict[str, float] = {}

    def train_step(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
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
        for name, t in (("inputs", inputs), ("targets", targets)):
            if t is not None and t.shape[0] % m:
                raise ValueError(
                    f"{name} hold {t.shape[0]} samples, not divisible into {m} micro-batches; use a "
                    f"batch size that is a multiple of {m} or another number of micro-batches"
                )
        xs = inputs.chunk(m) if first else None
        ys = targets.chunk(m) if last else None
        device = next(iter(self.stage.parameters()), torch.empty(0)).device
        saved: dict[int, dict] = {}
        losses: list[torch.Tensor] = []
        live = peak = 0
        busy = 0.0
        t_step = time.perf_counter()
        steps = self.schedule.steps(mesh.pp_size, mesh.pp_rank)
        last_backward = max(i for kind, i in steps if kind == "B")

        for kind, i in steps:
            if kind == "F":
                x = xs[i] if first else self.p2p.recv(mesh.prev_rank, device)
                t0 = time.perf_counter()
                if not first and x.is_floating_point():
                    x.requires_grad_(True)
                entry, nbytes = {"x": x}, _nbytes(x)
                if self.recompute:  # the recomputed forward replays this RNG state
                    entry["rng"] = torch.get_rng_state()
                with nvtx(f"stage{mesh.pp_rank} forward mb{i}"):
                    if self.recompute:
                        with torch.no_grad():
                            out = self._run(x, ys[i] if last else None)
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
                else:
                    self.p2p.send(out, mesh.next_rank)
            else:
                entry = saved.pop(i)
                grad = None if last else self.p2p.recv(mesh.next_rank, device)
                t0 = time.perf_counter()
                sync = i == last_backward or self.no_sync is None
                no_sync = contextlib.nullcontext() if sync else self.no_sync()
                with nvtx(f"stage{mesh.pp_rank} backward mb{i}"), no_sync:
                    if self.recompute:
                        rng = torch.get_rng_state()
                        torch.set_rng_state(entry["rng"])
                        with torch.enable_grad():
                            out = self._run(entry["x"], ys[i] if last else None)
                        torch.set_rng_state(rng)
                    else:
                        out = entry["out"]
                    if last:
                        loss = self.scale_loss(out) if self.scale_loss is not None else out
                        loss.backward()
                    else:
                        torch.autograd.backward(out, grad)
                busy += time.perf_counter() - t0
                live -= entry["bytes"]
                if not first and entry["x"].requires_grad:
                    self.p2p.send(entry["x"].grad, mesh.prev_rank)
        self.p2p.wait_sends()
        finish = getattr(self.stage, "finish_grad_sync", None)
        if finish is not None:  # e.g. DDP's tied-embedding reduction, once every stage is done
            finish()
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

    def _run(self, x: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        out = self.stage(x)
        if target is not None:
            out = self.loss_fn(out, target) / self.schedule.num_microbatches
        return out

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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
