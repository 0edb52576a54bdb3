"""``run``: train on this rank: steps, progress lines, metrics, profiling, checkpoints, and
stopping alike on every rank (preemption, divergence: ``fastpar.train.stop``).

Host syncs only at sync points: logged steps (every ``--log-every``, and the last) and save
steps. A step in between reads nothing on the host and makes no collective of its own: its
loss, gradient norm and skipped flag stay on the device until the next sync point, which reads
them all at once (``fastpar.train.metrics.resolve``), agrees over every rank on a stop (a
signal received, a divergence in any step since the last sync point) and on the peak memory
(one all-reduce), prints, saves, and stops. A SIGTERM / SIGINT is acted on at the next sync
point; a divergence found there stops the run before anything is saved.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

from fastpar.checkpoint.directory import step_dir
from fastpar.mesh import ParallelMesh
from fastpar.train.build import Trainer
from fastpar.train.checkpointing import _save, close_checkpoints, open_checkpoints
from fastpar.train.config import TrainConfig
from fastpar.train.metrics import global_param_count, memory_mib, mfu, progress_line, resolve
from fastpar.train.stop import RunStopped, StopSignals, agree, signal_name, weights_fit


def run(cfg: TrainConfig, tokens=None) -> list[dict]:
    """Train on this rank (the default process group must exist). Returns the step records.
    ``tokens``: the run's data, already checked (None: load them, unchecked).

    Every collective of every group times out after ``cfg.collective_timeout`` seconds. A
    SIGTERM / SIGINT to any rank (a scheduler's preemption) lets every rank finish its step,
    save it when ``cfg.checkpoint_dir`` is set, and raise ``RunStopped``; so does divergence (a
    non-finite loss in fp32 / bf16, ``cfg.max_skipped_steps`` skipped steps in a row, weights
    about to be saved that are not finite), without saving."""
    with StopSignals() as signals:
        mesh = ParallelMesh(cfg.tp, cfg.pp, cfg.ep, timeout=cfg.collective_timeout)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        trainer = Trainer(cfg, mesh, device, tokens)
        try:
            return _train(cfg, trainer, signals)
        finally:
            close_checkpoints(trainer)


def _train(cfg: TrainConfig, trainer: Trainer, signals: StopSignals) -> list[dict]:
    talk = dist.get_rank() == 0 and not cfg.quiet
    start = open_checkpoints(trainer, talk)  # lock, run id, resume; 0 without --checkpoint-dir
    total_params = global_param_count(trainer.stage_module, trainer.mesh, trainer.device)
    if talk:
        n = sum(p.numel() for p in trainer.stage_module.parameters())
        print(
            f"fastpar.train: {cfg.model_name}, world {cfg.world_size} = dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} "
            f"(ep {cfg.ep}), ZeRO-{cfg.zero}, {cfg.precision}, {cfg.schedule} x {cfg.microbatches} "
            f"micro-batches, {dist.get_backend()}; {total_params:,} parameters, rank 0 holds {n:,}",
            flush=True,
        )
    return _steps(cfg, trainer, start, total_params, talk, signals)


def _steps(
    cfg: TrainConfig, trainer: Trainer, start: int, total_params: int, talk: bool, signals
) -> list[dict]:
    prof = _profiler(cfg, trainer.device) if cfg.profile else contextlib.nullcontext()
    sync = SyncPoint(cfg, trainer, signals, talk, total_params)
    records: list[dict] = []
    pending: list[dict] = []  # the steps since the last sync point, their numbers on the device
    with prof as p:
        for _ in range(start, cfg.steps):
            rec = trainer.step()
            records.append(rec)
            pending.append(rec)
            if p is not None:
                p.step()
            logged = rec["step"] % cfg.log_every == 0 or rec["step"] == cfg.steps
            if logged or _saves(cfg, rec["step"]):
                sync(pending, logged)
                pending = []
    if cfg.profile:
        os.makedirs(cfg.profile, exist_ok=True)
        path = os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json")
        p.export_chrome_trace(path)
        if talk:
            print(f"profile: Chrome/Perfetto traces in {cfg.profile}/trace_rank*.json", flush=True)
    return records


class SyncPoint:
    """A logged or save step: the numbers of the steps since the last one, the agreement (stop
    signal, divergence, memory), the progress line, the checkpoint; raises ``RunStopped``."""

    def __init__(self, cfg, trainer: Trainer, signals, talk: bool, total_params: int) -> None:
        self.cfg, self.trainer, self.signals, self.talk = cfg, trainer, signals, talk
        self.total_params, self.watch = total_params, Divergence(cfg, trainer)
        self.since = time.perf_counter()

    def __call__(self, pending: list[dict], logged: bool) -> None:
        cfg, trainer, device = self.cfg, self.trainer, self.trainer.device
        rec, step = pending[-1], pending[-1]["step"]
        resolve(pending, trainer.mesh, device)
        seconds = time.perf_counter() - self.since
        diverged = self.watch.scan(pending)
        signum, any_diverged, mem = agree(
            self.signals.received, diverged is not None, memory_mib(device), device
        )
        if any_diverged and diverged is None:  # (the numbers are alike on every rank)
            diverged = RunStopped(f"diverged by step {step} on another rank", step, "divergence")
        if logged or diverged is not None:
            rec["max_mem_mib"] = mem
            if self.talk:
                tps = cfg.batch_size * cfg.seq_len * len(pending) / max(seconds, 1e-9)
                mfu_value = mfu(tps, self.total_params, device, cfg.world_size)
                print(progress_line(cfg, rec, tps, mfu_value), flush=True)
        if diverged is not None:
            raise diverged
        preempted = bool(signum) and step < cfg.steps
        saved = None
        if _saves(cfg, step) or (cfg.checkpoint_dir and preempted):
            _check_weights(cfg, trainer, step)
            _save(trainer, cfg.checkpoint_dir, step, self.talk)  # the last step always
            saved = step_dir(cfg.checkpoint_dir, step)
        if preempted:
            name = signal_name(signum)
            where = f"checkpoint {saved}" if saved else "no checkpoint (no --checkpoint-dir)"
            raise RunStopped(f"stopped by {name} after step {step}; {where}", step, name, saved)
        self.since = time.perf_counter()


def _saves(cfg, step: int) -> bool:
    """Whether ``step`` is saved (with --checkpoint-dir): every --save-every, and the last."""
    every = bool(cfg.save_every) and step % cfg.save_every == 0
    return bool(cfg.checkpoint_dir) and (every or step == cfg.steps)


class Divergence:
    """Watches the resolved steps for divergence: a non-finite loss (fp32 / bf16; fp16's scaler
    skips such steps and backs off), or ``max_skipped_steps`` skipped steps in a row (counted
    across sync points)."""

    def __init__(self, cfg, trainer: Trainer) -> None:
        self.cfg, self.trainer, self.streak = cfg, trainer, 0

    def scan(self, records: list[dict]) -> RunStopped | None:
        """The ``RunStopped`` of the first diverged step of ``records`` (its numbers resolved),
        or None."""
        cfg, last = self.cfg, records[-1]["step"]
        for rec in records:
            step = rec["step"]
            self.streak = self.streak + 1 if rec["skipped"] else 0
            unsaved = f"step {step} not saved" if step == last else f"steps {step}-{last} not saved"
            unsaved += "; lower --lr or resume from an earlier checkpoint"
            if not math.isfinite(rec["loss"]) and cfg.precision != "fp16":
                return RunStopped(
                    f"diverged at step {step}: the loss is {rec['loss']} ({cfg.precision}, --lr "
                    f"{cfg.lr:g}); {unsaved}",
                    last,
                    "non-finite loss",
                )
            if cfg.max_skipped_steps > 0 and self.streak >= cfg.max_skipped_steps:
                scaler = self.trainer.scaler
                scale = f", loss scale now {float(scaler.scale):g}" if scaler else ""
                return RunStopped(
                    f"diverged at step {step}: {self.streak} steps in a row (steps "
                    f"{step - self.streak + 1}-{step}) skipped for inf/NaN gradients{scale} "
                    f"(--max-skipped-steps {cfg.max_skipped_steps}); {unsaved}",
                    last,
                    "skipped steps",
                )
        return None


def _check_weights(cfg, trainer: Trainer, step: int) -> None:
    """Refuse to save weights (or fp32 masters) that are not finite in the model's precision."""
    dtype = next((p.dtype for p in trainer.stage_module.parameters()), torch.float32)
    tensors = [p for g in trainer.param_groups for p in g["params"]]
    if cfg.zero != 3:  # ZeRO-3 holds its parameters in the optimizer's shards only
        tensors += list(trainer.stage_module.parameters())
    if not weights_fit(tensors, dtype, trainer.device):
        raise RunStopped(
            f"diverged at step {step}: the weights are no longer finite in {cfg.precision} "
            f"(--lr {cfg.lr:g}); step {step} not saved; lower --lr or resume from an earlier "
            "checkpoint",
            step,
            "non-finite weights",
        )


def _profiler(cfg: TrainConfig, device: torch.device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, record_shapes=False)
