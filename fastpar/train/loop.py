"""``run``: train on this rank: steps, progress lines, metrics, profiling, checkpoints, and
stopping alike on every rank (preemption, divergence: ``fastpar.train.stop``)."""

from __future__ import annotations

import contextlib
import math
import os
import resource

import torch
import torch.distributed as dist

from fastpar.checkpoint.directory import step_dir
from fastpar.mesh import ParallelMesh
from fastpar.train.build import Trainer
from fastpar.train.checkpointing import _save, close_checkpoints, open_checkpoints
from fastpar.train.config import TrainConfig
from fastpar.train.stop import RunStopped, StopSignals, agree, signal_name, weights_fit

#: dense bf16 tensor-core peak FLOP/s by device name (for MFU)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def _global_param_count(trainer: Trainer) -> int:
    """Parameters of the whole model, each counted once across the layout (one all-reduce)."""
    from fastpar.amp.norm import counts_on_this_rank

    mesh = trainer.mesh
    n = sum(
        p.numel() for p in trainer.stage_module.parameters() if counts_on_this_rank(p, mesh=mesh)
    )
    t = torch.tensor(float(n), device=trainer.device)
    dist.all_reduce(t)
    return int(t.item())


def _mfu(tokens_per_s: float, params: int, device: torch.device, world: int) -> float | None:
    """Model FLOPs utilisation: 6 FLOPs per parameter per token (forward + backward) against the
    GPUs' peak; None off CUDA or on a device not in PEAK_FLOPS."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else 6 * params * tokens_per_s / (peak * world)


def _memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


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
    total_params = _global_param_count(trainer)
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
    device = trainer.device
    tokens_per_step = cfg.batch_size * cfg.seq_len
    prof = _profiler(cfg, device) if cfg.profile else contextlib.nullcontext()
    records, streak = [], 0
    with prof as p:
        for _ in range(start, cfg.steps):
            rec = trainer.step()
            records.append(rec)
            if p is not None:
                p.step()
            step = rec["step"]
            signum, bad_loss, skipped = agree(
                signals.received, not math.isfinite(rec["loss"]), rec["skipped"], device
            )
            streak = streak + 1 if skipped else 0
            diverged = _divergence(cfg, trainer, step, rec, bad_loss, streak)
            log_step = step % cfg.log_every == 0 or step == cfg.steps or diverged is not None
            if log_step:  # the same on every rank: one small MAX all-reduce per logged step
                mem = torch.tensor(_memory_mib(device), device=device)  # NCCL needs it on the GPU
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
                rec["max_mem_mib"] = float(mem)
            if talk and log_step:
                tps = tokens_per_step / rec["seconds"]
                mfu = _mfu(tps, total_params, device, cfg.world_size)
                line = (
                    f"{_bar(step, cfg.steps)} step {step:>4}/{cfg.steps} | loss {rec['loss']:.4f} "
                    f"| lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | {tps:,.0f} tok/s "
                    f"| mem {rec['max_mem_mib']:.0f} MiB/rank"
                    + (f" | MFU {mfu:.1%}" if mfu is not None else "")
                    + (" | skipped" if rec["skipped"] else "")
                )
                print(line, flush=True)
            if diverged is not None:
                raise diverged
            preempted = bool(signum) and step < cfg.steps
            every = cfg.save_every and step % cfg.save_every == 0
            saved = None
            if cfg.checkpoint_dir and (every or step == cfg.steps or preempted):
                _check_weights(cfg, trainer, step)
                _save(trainer, cfg.checkpoint_dir, step, talk)  # the last step always
                saved = step_dir(cfg.checkpoint_dir, step)
            if preempted:
                name = signal_name(signum)
                where = f"checkpoint {saved}" if saved else "no checkpoint (no --checkpoint-dir)"
                raise RunStopped(f"stopped by {name} after step {step}; {where}", step, name, saved)
    if cfg.profile:
        os.makedirs(cfg.profile, exist_ok=True)
        path = os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json")
        p.export_chrome_trace(path)
        if talk:
            print(f"profile: Chrome/Perfetto traces in {cfg.profile}/trace_rank*.json", flush=True)
    return records


def _divergence(cfg, trainer: Trainer, step: int, rec: dict, bad_loss: bool, streak: int):
    """The ``RunStopped`` to raise (alike on every rank: the flags are agreed), or None: for a
    non-finite loss (fp32 / bf16; fp16's scaler skips such steps and backs off), or for
    ``max_skipped_steps`` skipped steps in a row."""
    unsaved = f"step {step} not saved; lower --lr or resume from an earlier checkpoint"
    if bad_loss and cfg.precision != "fp16":
        return RunStopped(
            f"diverged at step {step}: the loss is {rec['loss']} ({cfg.precision}, --lr "
            f"{cfg.lr:g}); {unsaved}",
            step,
            "non-finite loss",
        )
    if cfg.max_skipped_steps > 0 and streak >= cfg.max_skipped_steps:
        scale = f", loss scale now {float(trainer.scaler.scale):g}" if trainer.scaler else ""
        return RunStopped(
            f"diverged at step {step}: {streak} steps in a row (steps {step - streak + 1}-{step}) "
            f"skipped for inf/NaN gradients{scale} (--max-skipped-steps {cfg.max_skipped_steps}); "
            f"{unsaved}",
            step,
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
