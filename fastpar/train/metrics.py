"""A run's numbers, read on the steps that need them: the losses, gradient norms and skipped
flags of the steps since the last read (``resolve``: one host sync), the memory, the progress
line, tokens per second and MFU."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from fastpar.amp.norm import counts_on_this_rank

#: dense bf16 tensor-core peak FLOP/s by device name (for MFU)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def resolve(records: list[dict], mesh, device: torch.device) -> None:
    """Turn the device tensors of ``records`` (``Trainer.step``'s, of the steps since the last
    call) into numbers, alike on every rank: ``loss`` averaged over data parallelism (the last
    pipeline stage's, broadcast over the pipeline group), ``grad_norm`` (global already) and
    ``skipped``. One broadcast over the pipeline group, one all-reduce over data parallelism,
    one host sync, whatever the number of records."""
    if not records:
        return
    zero = torch.zeros((), dtype=torch.float32, device=device)
    losses = torch.stack([zero if r["loss"] is None else r["loss"] for r in records])
    if mesh.pp_size > 1:
        dist.broadcast(losses, src=mesh.ranks("pp")[-1], group=mesh.pp_group)
    dist.all_reduce(losses, group=mesh.dp_group)
    norms = torch.stack([r["grad_norm"].reshape(()).float() for r in records])
    skipped = torch.stack([r["skipped"].reshape(()).float() for r in records])
    values = torch.cat([losses, norms.to(device), skipped.to(device)]).tolist()
    k = len(records)
    for i, r in enumerate(records):
        r["loss"] = values[i] / mesh.dp_size
        r["grad_norm"] = values[k + i]
        r["skipped"] = values[2 * k + i] > 0


def global_param_count(module: torch.nn.Module, mesh, device: torch.device) -> int:
    """Parameters of the whole model, each counted once across the layout (one all-reduce)."""
    n = sum(p.numel() for p in module.parameters() if counts_on_this_rank(p, mesh=mesh))
    t = torch.tensor(float(n), device=device)
    dist.all_reduce(t)
    return int(t.item())


def mfu(tokens_per_s: float, params: int, device: torch.device, world: int) -> float | None:
    """Model FLOPs utilisation: 6 FLOPs per parameter per token (forward + backward) against the
    GPUs' peak; None off CUDA or on a device not in PEAK_FLOPS."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else 6 * params * tokens_per_s / (peak * world)


def memory_mib(device: torch.device) -> float:
    """This rank's peak memory: the GPU's allocated bytes, else the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def progress_line(cfg, rec: dict, tokens_per_s: float, mfu_value: float | None) -> str:
    """Rank 0's line for a logged step."""
    step = rec["step"]
    return (
        f"{bar(step, cfg.steps)} step {step:>4}/{cfg.steps} | loss {rec['loss']:.4f} "
        f"| lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | {tokens_per_s:,.0f} tok/s "
        f"| mem {rec['max_mem_mib']:.0f} MiB/rank"
        + (f" | MFU {mfu_value:.1%}" if mfu_value is not None else "")
        + (" | skipped" if rec["skipped"] else "")
    )
