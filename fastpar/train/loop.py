"""``run``: train on this rank: steps, progress lines, metrics, evaluation, profiling, checkpoints,
and stopping alike on every rank. Host syncs only at sync points (logged and save steps):
docs/training.md ("Inside fastpar.train")."""

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
from fastpar.train.checks import check_same_settings
from fastpar.train.compile import compile_blocks
from fastpar.train.config import TrainConfig
from fastpar.train.metrics import (
    MetricsWriter,
    flops_per_token,
    memory_mib,
    metrics_row,
    param_counts,
    progress_line,
    reserved_mib,
    resolve,
)
from fastpar.train.stop import RunStopped, StopSignals, agree, signal_name, weights_fit
from fastpar.train.stragglers import rank_times
from fastpar.train.summary import header_line, hybrid_line


def run(cfg: TrainConfig, tokens=None) -> list[dict]:
    """Train on this rank (the default process group must exist). Returns the step records.
    ``tokens``: the run's data, already checked (None: load them, unchecked). A signal or a
    divergence raises ``RunStopped`` on every rank (docs/training.md, "When things go wrong")."""
    check_same_settings(cfg)  # one small all-gather: nodes started with other flags stop here
    with StopSignals() as signals:
        mesh = ParallelMesh(
            cfg.tp,
            cfg.pp,
            cfg.ep,
            timeout=cfg.collective_timeout,
            cp=cfg.cp,
            dp_shard=cfg.dp_shard,
            dp_replicate=cfg.dp_replicate,
        )
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        trainer = Trainer(cfg, mesh, device, tokens)
        if cfg.compile:
            compile_blocks(trainer.stage_module)
        try:
            return _train(cfg, trainer, signals)
        finally:
            close_checkpoints(trainer)


def model_counts(trainer: Trainer) -> tuple[dict[str, int], int]:
    """``param_counts`` of the whole model (the header's count, the FLOPs' N) and the
    parameters this rank's stage holds in its layout. ZeRO-3's parameters are empty between
    steps: they are counted gathered (a collective: every rank calls this)."""
    zero3 = trainer.cfg.zero == 3
    with trainer.model.summon_full_params() if zero3 else contextlib.nullcontext():
        counts = param_counts(trainer.stage_module, trainer.mesh, trainer.device)
        return counts, sum(p.numel() for p in trainer.stage_module.parameters())


def _train(cfg: TrainConfig, trainer: Trainer, signals: StopSignals) -> list[dict]:
    talk = dist.get_rank() == 0 and not cfg.quiet
    start = open_checkpoints(trainer, talk)  # lock, run id, resume; 0 without --checkpoint-dir
    counts, n = model_counts(trainer)
    total_params = counts["total"]
    if talk:
        print(header_line(cfg, dist.get_backend(), total_params, n), flush=True)
        if trainer.mesh.layout.hybrid:
            print(hybrid_line(cfg, trainer.mesh.layout), flush=True)
        if cfg.packs_documents:
            print(
                f"packed documents ({cfg.document_source or '--pack documents'}): attention "
                f"stops at each document, positions "
                f"{'restart' if cfg.reset_positions else 'run on'}, {cfg.loss_normalization} "
                "loss normalisation",
                flush=True,
            )
    writer = MetricsWriter(cfg, resumed=start > 0) if dist.get_rank() == 0 else None
    try:
        return _steps(cfg, trainer, start, flops_per_token(cfg, counts), talk, signals, writer)
    finally:
        if writer is not None:
            writer.close()


def _steps(
    cfg: TrainConfig, trainer: Trainer, start: int, flops: float, talk: bool, signals, writer
) -> list[dict]:
    profiling = bool(cfg.profile) and start < cfg.profile_window[1]  # (resumed past it: no)
    prof = _profiler(cfg, trainer.device) if profiling else contextlib.nullcontext()
    sync = SyncPoint(cfg, trainer, signals, talk, flops, writer, start)
    records: list[dict] = []
    pending: list[dict] = []  # the steps since the last sync point, their numbers on the device
    with prof as p:
        while p is not None and p.step_num <= start:
            p.step()  # the profiler's step N is the run's step N (0: before the first)
        if cfg.compile and talk and start < cfg.steps:
            print("compiling (first step)...", flush=True)
        for _ in range(start, cfg.steps):
            rec = trainer.step()
            records.append(rec)
            pending.append(rec)
            evaluated = evaluates_at(cfg, rec["step"])
            if evaluated:  # forward-only over held-out batches, on every rank (a host sync)
                rec["val_loss"] = trainer.evaluate()
            if p is not None:
                p.step()
            logged = rec["step"] % cfg.log_every == 0 or rec["step"] == cfg.steps or evaluated
            if logged or _saves(cfg, rec["step"]):
                sync(pending, logged)
                pending = []
            if cfg.compile and rec["step"] == start + 1:
                sync.compiled()  # the ETA and the run's speed leave the compile step out
    if profiling and talk:
        first, last = cfg.profile_window
        print(
            f"profile: steps {max(first, start + 1)}-{last}, Chrome/Perfetto traces in "
            f"{cfg.profile}/trace_rank*.json",
            flush=True,
        )
    return records


class SyncPoint:
    """A logged or save step: the numbers of the steps since the last one, the agreement (stop
    signal, divergence, memory), the progress line, the checkpoint; raises ``RunStopped``."""

    def __init__(
        self, cfg, trainer: Trainer, signals, talk: bool, flops: float, writer, start: int
    ) -> None:
        self.cfg, self.trainer, self.signals, self.talk = cfg, trainer, signals, talk
        self.flops, self.writer, self.watch = flops, writer, Divergence(cfg, trainer)
        self.start, self.skipped = start, 0  # skipped since the last logged step
        self.began = self.since = time.perf_counter()
        self.compile_s, self.compile_steps = 0.0, 0  # --compile: the first step's time

    def compiled(self) -> None:
        """After the first step of a --compile run: its time (compiling included) is kept out of the
        ETA's rate and of the run's tokens/s (a device sync when it was no sync point)."""
        if self.compile_steps:  # the first step was a sync point: marked there
            return
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)
        self.compile_s, self.compile_steps = time.perf_counter() - self.began, 1

    def __call__(self, pending: list[dict], logged: bool) -> None:
        cfg, trainer, device = self.cfg, self.trainer, self.trainer.device
        rec, step = pending[-1], pending[-1]["step"]
        if logged and device.type == "cuda":  # this rank's arrival: its queued work done
            torch.cuda.synchronize(device)
        arrived = time.perf_counter()
        resolve(pending, trainer.mesh, device)
        seconds = time.perf_counter() - self.since
        waited = time.perf_counter() - arrived  # for the slowest rank (resolve syncs the ranks)
        if cfg.compile and step == self.start + 1:  # the compile step (resolve synced)
            self.compile_s, self.compile_steps = time.perf_counter() - self.began, 1
        diverged = self.watch.scan(pending)
        signum, any_diverged, mem = agree(
            self.signals.received, diverged is not None, memory_mib(device), device
        )
        if any_diverged and diverged is None:  # (the numbers are alike on every rank)
            diverged = RunStopped(f"diverged by step {step} on another rank", step, "divergence")
        self.skipped += sum(bool(r["skipped"]) for r in pending)
        if logged or diverged is not None:
            rec["max_mem_mib"] = mem
            row = metrics_row(
                cfg,
                pending,
                seconds=seconds,
                elapsed=time.perf_counter() - self.began,
                steps_run=step - self.start,
                flops=self.flops,
                device=device,
                mem=(mem, reserved_mib(device)),
                skipped_steps=self.skipped,
                compile_s=self.compile_s,
                compile_steps=self.compile_steps,
            ) | rank_times(arrived - self.since, waited, len(pending), device)
            self.skipped = 0
            if self.writer is not None:
                self.writer.write(row)
            if self.talk:
                print(progress_line(cfg, row), flush=True)
        if diverged is not None:
            raise diverged
        if step == cfg.steps:  # the run's speed, for the end-of-run line
            timed = step - self.start - self.compile_steps
            seconds = time.perf_counter() - self.began - self.compile_s
            if timed > 0 and seconds > 0:
                rec["run_tokens_per_s"] = cfg.batch_size * cfg.model.seq_len * timed / seconds
        preempted = bool(signum) and step < cfg.steps
        saved = None
        if _saves(cfg, step) or (cfg.checkpoint_dir and preempted):
            _check_weights(cfg, trainer, step)
            if _save(trainer, cfg.checkpoint_dir, step, self.talk):  # the last step always
                saved = step_dir(cfg.checkpoint_dir, step)
        if preempted:
            name = signal_name(signum)
            where = f"checkpoint {saved}" if saved else "no checkpoint (no --checkpoint-dir)"
            raise RunStopped(f"stopped by {name} after step {step}; {where}", step, name, saved)
        self.since = time.perf_counter()


def evaluates_at(cfg, step: int) -> bool:
    """Whether ``step`` measures the validation loss: every --eval-every, and the last (a
    logged step: its line and metrics row carry ``val_loss``)."""
    return bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)


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
        self.clean = False  # whether any step has run without an inf/NaN gradient
        # the back-off from a start scale above the default is not counted: every accepted
        # --loss-scale (up to 2^40) comes down to the default's 4096 before
        # --max-skipped-steps applies, as a run started there would
        scaler = trainer.scaler
        down = getattr(scaler, "overflows_to", None)
        self.backing_off = down(TrainConfig.loss_scale) if down is not None else 0

    def scan(self, records: list[dict]) -> RunStopped | None:
        """The ``RunStopped`` of the first diverged step of ``records`` (its numbers resolved),
        or None."""
        cfg, last = self.cfg, records[-1]["step"]
        for rec in records:
            step = rec["step"]
            self.streak = self.streak + 1 if rec["skipped"] else 0
            self.clean = self.clean or not rec["skipped"]
            unsaved = f"step {step} not saved" if step == last else f"steps {step}-{last} not saved"
            unsaved += "; lower --lr or resume from an earlier checkpoint"
            if not math.isfinite(rec["loss"]) and cfg.precision != "fp16":
                return RunStopped(
                    f"diverged at step {step}: the loss is {rec['loss']} ({cfg.precision}, --lr "
                    f"{cfg.lr:g}); {unsaved}",
                    last,
                    "non-finite loss",
                )
            allowed = cfg.max_skipped_steps + (0 if self.clean else self.backing_off)
            if cfg.max_skipped_steps > 0 and self.streak >= allowed:
                scaler = self.trainer.scaler
                scale = f", loss scale now {float(scaler.scale):g}" if scaler else ""
                if scaler is not None and not self.clean:
                    free = (
                        f"; its first {self.backing_off} skipped steps, the back-off to "
                        f"{TrainConfig.loss_scale:g}, not counted"
                        if self.backing_off
                        else ""
                    )
                    return RunStopped(
                        f"stopped at step {step}: every step so far ({self.streak}) skipped for "
                        f"inf/NaN gradients while the fp16 loss scaler backs off from its start "
                        f"--loss-scale {cfg.loss_scale:g} (now {float(scaler.scale):g}"
                        f"{free}): the "
                        f"start scale is too large, the run has not diverged; pass a lower "
                        f"--loss-scale (default 4096) or a larger --max-skipped-steps "
                        f"({cfg.max_skipped_steps})",
                        last,
                        "loss scale backing off",
                    )
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
    """A ``torch.profiler.profile`` whose step N is the run's step N (``_steps`` steps it to
    ``start + 1`` first): waits until step A - 1 of --profile-steps A:B, warms up in it, records
    steps A to B and writes this rank's trace to ``DIR/trace_rank<R>.json`` (also when the run
    stops inside the window). Kineto's own log lines are off under --quiet and on every rank
    but 0 (``KINETO_LOG_LEVEL``, unless set: KINETO_LOG_LEVEL=0 shows every rank's)."""
    if cfg.quiet or dist.get_rank() != 0:
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # read at this process's first profile
    first, last = cfg.profile_window
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    path = os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json")

    def export(prof) -> None:
        os.makedirs(cfg.profile, exist_ok=True)
        prof.export_chrome_trace(path)

    schedule = torch.profiler.schedule(wait=first - 1, warmup=1, active=last - first + 1, repeat=1)
    return torch.profiler.profile(
        activities=acts, schedule=schedule, on_trace_ready=export, record_shapes=False
    )
