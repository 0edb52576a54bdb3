"""How much memory one micro-batch's activations need, against what this machine has: a run
that clearly cannot fit is refused before any rank starts (``check_memory``). What the estimate
counts, and how close it is: docs/training.md, "Inside fastpar.train"."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fastpar.models.activations import mtp_bytes, mtp_grads
from fastpar.parallel.pipeline.partition import partition
from fastpar.parallel.pipeline.schedules import make_schedule

GIB = 2**30

#: warn when the estimate exceeds this fraction of the memory
WARN_FRACTION = 0.5


@dataclass(frozen=True)
class MemoryEstimate:
    """``needed`` bytes of activations (at least) against ``available`` bytes of ``where``
    (the GPU of one rank, or this machine's RAM shared by ``ranks`` ranks)."""

    needed: int
    available: int
    where: str
    ranks: int

    @property
    def fraction(self) -> float:
        return self.needed / max(1, self.available)

    def describe(self, cfg) -> str:
        rows = cfg.batch_size // cfg.dp // cfg.microbatches
        whose = "one rank" if self.ranks == 1 else f"the {self.ranks} ranks on this machine"
        return (
            f"the activations kept for backward ({rows} rows x {cfg.model.seq_len} tokens a "
            f"micro-batch, {cfg.schedule}) need at least {self.needed / GIB:.1f} GiB on {whose}, "
            f"against {self.available / GIB:.1f} GiB of {self.where}"
        )


def stage_bytes(cfg) -> list[int]:
    """The bytes of activations each pipeline rank keeps for backward at its peak in a step:
    what each of its chunks keeps per micro-batch, held as the schedule holds them (``held``);
    with --recompute full each micro-batch keeps only its stage input and one chunk is
    recomputed at a time (ZB-H1: its B recomputes, and that graph lives until the W)."""
    model = cfg.model
    sched = make_schedule(
        cfg.schedule, cfg.microbatches, cfg.virtual_stages, cfg.microbatch_group_size
    )
    tp, pp, v = cfg.tp, cfg.pp, sched.virtual_stages
    sp = tp if cfg.model.sequence_parallel else 1
    tokens = (cfg.batch_size // cfg.dp // cfg.microbatches) * cfg.model.seq_len
    size = 2 if cfg.precision in ("bf16", "fp16", "fp8") else 4
    act = model.activation_bytes(tp, sp, size, cfg.fused_ce)
    depth = getattr(model, "mtp_depth", 0)
    kinds = [act.moe if model.is_moe(i) else act.dense for i in range(model.layers + depth)]
    # the head block holds the MTP modules (their blocks layers L .. L + D - 1) after the head
    head = act.head + sum(mtp_bytes(model, act, b, sp, size) for b in kinds[model.layers :])
    blocks = [act.embedding, *kinds[: model.layers], head]
    # the fused cross-entropy's gradient of the head weight (once the main head, once each MTP
    # module), unless it is recomputed in backward (a schedule running every forward first:
    # build's loss)
    fixed = 0.0 if sched.forwards_first else act.head_fixed * (1 + depth)
    # a split backward's stored output gradients (none in the chunk that takes the token ids)
    g_kinds = [act.moe_grads if model.is_moe(i) else act.dense_grads for i in range(len(kinds))]
    g_head = act.head_grads + sum(
        mtp_grads(model, act, g, sp, size) for g in g_kinds[model.layers :]
    )
    grads = [0.0, *g_kinds[: model.layers], g_head]
    ranges = partition([1.0] * len(blocks), pp * v)  # build_stage / build_virtual_stages
    peaks = []
    for s in range(pp):
        mine = ranges[s::pp]
        full = [sum(blocks[a:b]) * tokens + (fixed if b == len(blocks) else 0) for a, b in mine]
        stored = [0.0 if a == 0 else sum(grads[a:b]) * tokens for a, b in mine]
        if cfg.recompute is True:  # full; a selective policy is counted as none (an upper bound)
            width = model.hidden / sp * size  # a later stage's input: the hidden states
            kept = [(act.embedding if a == 0 else width) * tokens for a, _ in mine]
            if sched.splits_backward:  # B recomputes the forward, whose graph lives until W
                rebuilt = [f - k + g for f, k, g in zip(full, kept, stored, strict=True)]
                peaks.append(sched.held(pp, s, kept, rebuilt))
                continue
            extra = max(f - k for f, k in zip(full, kept, strict=True))
            peaks.append(sched.held(pp, s, kept) + extra)
        else:
            peaks.append(sched.held(pp, s, full, stored))
    return [int(p) for p in peaks]


def activation_bytes(cfg) -> tuple[int, int] | None:
    """(the busiest rank, the whole world): the bytes of activations kept for backward at a rank's
    peak in a step (``stage_bytes``); the world's is the sum of every rank's peak (reached within
    the same step). None for a --hf-config model (its blocks are Hugging Face's)."""
    if cfg.hf_config:
        return None
    peaks = stage_bytes(cfg)
    return max(peaks), sum(peaks) * cfg.tp * cfg.dp


def _ram_available() -> int:
    """Bytes of RAM available now (MemAvailable of /proc/meminfo), else the physical RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimate(cfg) -> MemoryEstimate | None:
    """The activations of one micro-batch against the memory they share: one rank's GPU, or
    this machine's RAM for the ranks it runs (all of them when self-started; under torchrun
    LOCAL_WORLD_SIZE of WORLD_SIZE). None when the model is not fastpar's."""
    sizes = activation_bytes(cfg)
    if sizes is None:
        return None
    rank_bytes, world_bytes = sizes
    if torch.cuda.is_available():  # one GPU per rank: this rank's own
        device = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(device).total_memory
        return MemoryEstimate(
            rank_bytes, total, f"GPU memory ({torch.cuda.get_device_name(device)})", 1
        )
    world = cfg.world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if "RANK" in os.environ else world
    here = world_bytes * min(local, world) // world
    return MemoryEstimate(here, _ram_available(), "RAM available", min(local, world))


def check_memory(cfg) -> MemoryEstimate | None:
    """Raise ValueError (one line: the estimate and the fix) when one micro-batch's activations
    clearly do not fit; else return the estimate (None: not estimated)."""
    est = estimate(cfg)
    if est is not None and est.needed > est.available:
        raise ValueError(
            f"--seq-len {cfg.model.seq_len} --batch-size {cfg.batch_size}: {est.describe(cfg)}; use a "
            f"shorter --seq-len, a smaller --batch-size, more --microbatches or more --tp"
        )
    return est
