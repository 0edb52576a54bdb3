"""How much memory one micro-batch's activations need, against what this machine has: a run
that clearly cannot fit is refused before any rank starts (``check_memory``).

The estimate is meant as a lower bound: it counts only tensors every block of fastpar's GPT /
Llama keeps for backward (the residual-stream inputs and norm outputs, the attention's
q / k / v and output, the MLP's or the experts' activations, the logits and their gradient),
times the micro-batches the schedule keeps in flight. The attention scores are not counted:
``scaled_dot_product_attention`` runs a fused kernel on CPUs and GPUs alike, which keeps
O(seq_len) per head, not O(seq_len²). Parameters, optimizer state and the allocator's slack come
on top. Measured on CPU ranks (gloo), the real growth with seq_len is 1.1x-2.1x the estimate
(tests/test_train_config.py checks that it is never below).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

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
            f"the activations kept for backward ({rows} rows x {cfg.seq_len} tokens a "
            f"micro-batch, {cfg.schedule}) need at least {self.needed / GIB:.1f} GiB on {whose}, "
            f"against {self.available / GIB:.1f} GiB of {self.where}"
        )


def _layer_elements(model, tp: int, sp: int) -> tuple[float, float]:
    """Elements per token that one dense and one MoE block keep for backward on one rank."""
    h = model.hidden
    if hasattr(model, "num_kv_heads"):  # Llama: GQA, SwiGLU (gate|up, silu, product)
        q, kv = model.heads * model.head_size, model.num_kv_heads * model.head_size
        attention, mlp_per_width, expert_ffn = 3 * q + 2 * kv, 4, model.moe_ffn_size
    else:  # GPT: fused q|k|v, GELU MLP (fc output, gelu output)
        attention, mlp_per_width, expert_ffn = 5 * h, 2, model.ffn_size
    residual = 4 * h / sp  # block input, norm output, mid-block residual, second norm output
    dense = residual + attention / tp + mlp_per_width * model.ffn_size / tp
    # dropless routing sends every token to top_k experts (each keeps the token's copy, its
    # hidden activations and its output); with a capacity some tokens may be dropped
    routed = model.top_k if model.capacity_factor is None else 0
    moe = residual + attention / tp + routed * (2 * h + mlp_per_width * expert_ffn / tp)
    shared = getattr(model, "shared_expert_ffn", None)  # a dense FFN on every token, not split
    if shared is not None:
        moe += mlp_per_width * shared + h
    return dense, moe


def _in_flight(cfg, stage: int) -> int:
    """Micro-batches stage ``stage`` holds at its peak: all of them under GPipe, under 1F1B its
    warm-up forwards and one more."""
    if cfg.schedule == "gpipe":
        return cfg.microbatches
    return min(cfg.pp - stage, cfg.microbatches)


def activation_bytes(cfg) -> tuple[int, int] | None:
    """(the busiest rank, the whole world): the bytes of activations kept for backward at a
    rank's peak in a step, under the schedule (1F1B: ``pp - stage`` micro-batches in flight;
    GPipe: all; with --recompute each micro-batch keeps only its stage input, and one is
    recomputed at a time); the world's is the sum of every rank's peak (reached within the
    same step). None for a --hf-config model (its blocks are Hugging Face's)."""
    from fastpar.parallel.pipeline.partition import partition

    if cfg.hf_config:
        return None
    model = cfg.model()
    tp, pp = cfg.tp, cfg.pp
    sp = tp if cfg.sequence_parallel else 1
    tokens = (cfg.batch_size // cfg.dp // cfg.microbatches) * cfg.seq_len
    size = 2 if cfg.precision in ("bf16", "fp16") else 4
    dense, moe = _layer_elements(model, tp, sp)
    layer = [moe if model.is_moe(i) else dense for i in range(model.layers)]
    vocab = model.vocab_size / tp
    # the head: final norm input and output, the logits and their gradient in the model's
    # dtype and (cross-entropy's) in fp32
    head = (2 * model.hidden / sp + 2 * vocab) * size + (2 * vocab * 4 if size != 4 else 0)
    peaks = []
    for s, (start, end) in enumerate(partition([1.0] * (model.layers + 2), pp)):
        held = sum(layer[i - 1] for i in range(max(start, 1), min(end, model.layers + 1))) * size
        held += head if end == model.layers + 2 else 0
        if cfg.recompute is True:  # full; a selective policy is counted as none (an upper bound)
            kept = 0 if s == 0 else model.hidden / sp * size  # stage 0's input is the token ids
            peaks.append(held + (_in_flight(cfg, s) - 1) * kept)
        else:
            peaks.append(held * _in_flight(cfg, s))
    return int(max(peaks) * tokens), int(sum(peaks) * tokens * tp * cfg.dp)


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
            f"--seq-len {cfg.seq_len} --batch-size {cfg.batch_size}: {est.describe(cfg)}; use a "
            f"shorter --seq-len, a smaller --batch-size, more --microbatches or more --tp"
        )
    return est
