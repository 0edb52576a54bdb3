"""``run``: train on this rank: steps, progress lines, metrics, profiling, checkpoints."""

from __future__ import annotations

import contextlib
import os
import resource

import torch
import torch.distributed as dist

from fastpar.mesh import ParallelMesh
from fastpar.train.build import Trainer
from fastpar.train.checkpointing import _resume, _save
from fastpar.train.config import TrainConfig

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
    ``tokens``: the run's data, already checked (None: load them, unchecked)."""
    mesh = ParallelMesh(cfg.tp, cfg.pp, cfg.ep)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    trainer = Trainer(cfg, mesh, device, tokens)
    talk = dist.get_rank() == 0 and not cfg.quiet
    start = 0
    if cfg.resume and cfg.checkpoint_dir:
        start = _resume(trainer, cfg.checkpoint_dir, talk)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    total_params = _global_param_count(trainer)
    if talk:
        n = sum(p.numel() for p in trainer.stage_module.parameters())
        print(
            f"fastpar.train: {cfg.model_name}, world {cfg.world_size} = dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} "
            f"(ep {cfg.ep}), ZeRO-{cfg.zero}, {cfg.precision}, {cfg.schedule} x {cfg.microbatches} "
            f"micro-batches, {dist.get_backend()}; {total_params:,} parameters, rank 0 holds {n:,}",
            flush=True,
        )
    prof = _profiler(cfg, device) if cfg.profile else contextlib.nullcontext()
    records = []
    with prof as p:
        for _ in range(start, cfg.steps):
            rec = trainer.step()
            records.append(rec)
            if p is not None:
                p.step()
            log_step = rec["step"] % cfg.log_every == 0 or rec["step"] == cfg.steps
            if log_step:  # the same on every rank: one small MAX all-reduce per logged step
                mem = torch.tensor(_memory_mib(device), device=device)  # NCCL needs it on the GPU
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
                rec["max_mem_mib"] = float(mem)
            if talk and log_step:
                tps = tokens_per_step / rec["seconds"]
                mfu = _mfu(tps, total_params, device, cfg.world_size)
                line = (
                    f"{_bar(rec['step'], cfg.steps)} step {rec['step']:>4}/{cfg.steps} | loss {rec['loss']:.4f} "
                    f"| lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | {tps:,.0f} tok/s "
                    f"| mem {rec['max_mem_mib']:.0f} MiB/rank"
                    + (f" | MFU {mfu:.1%}" if mfu is not None else "")
                    + (" | skipped" if rec["skipped"] else "")
                )
                print(line, flush=True)
            every = cfg.save_every and rec["step"] % cfg.save_every == 0
            if cfg.checkpoint_dir and (every or rec["step"] == cfg.steps):  # the last step always
                _save(trainer, cfg.checkpoint_dir, rec["step"], talk)
    if cfg.profile:
        os.makedirs(cfg.profile, exist_ok=True)
        path = os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json")
        p.export_chrome_trace(path)
        if talk:
            print(f"profile: Chrome/Perfetto traces in {cfg.profile}/trace_rank*.json", flush=True)
    return records


def _profiler(cfg: TrainConfig, device: torch.device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, record_shapes=False)
