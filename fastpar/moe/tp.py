"""Tensor parallelism inside ``MoE``: the replicated layout, expert tensor parallelism (ETP) and
sequence-parallel tokens (docs/moe.md, "Tensor parallelism inside the layer")."""

from __future__ import annotations

import torch


def layout_of(tp: int, sequence_parallel: bool, expert_tp: bool) -> str:
    """Which layout ("replicated", "expert_tp" or "sequence", docs/moe.md) a layer with
    these settings runs."""
    if tp == 1 or not (sequence_parallel or expert_tp):
        return "replicated"
    return "expert_tp" if expert_tp else "sequence"


def check(layout: str, tp: int, ffn: int, capacity_factor, overlap_chunks: int) -> None:
    """Refuse what a layout cannot do exactly, naming the value and the fix."""
    if layout == "expert_tp":
        if ffn % tp:
            raise ValueError(
                f"expert_tp: ffn_hidden_size {ffn} is not divisible by the tensor-parallel size "
                f"{tp}; use an expert width that is a multiple of {tp}"
            )
        if overlap_chunks > 1:
            raise ValueError(
                "expert_tp with overlap_chunks > 1 is not supported (the chunked all-to-all "
                "overlap runs its experts outside autograd); use overlap_chunks=1"
            )
    if layout == "sequence" and capacity_factor is not None:
        raise ValueError(
            f"sequence_parallel MoE at tp={tp} routes each TP rank's chunk of the sequence; with "
            f"capacity_factor={capacity_factor} the capacity would be per chunk and drop other "
            "tokens than the single-process layer. Use dropless routing (capacity_factor=None), "
            "or expert_tp=True (which routes the whole sequence)"
        )


def shard_ffn(t: torch.Tensor, dim: int, rank: int, world: int, gated: bool) -> torch.Tensor:
    """This TP rank's part of dim ``dim`` (the FFN width, F or gate | up = 2F) of ``t``: a
    contiguous 1/world slice, of each half when ``gated``."""
    halves = t.chunk(2, dim) if gated else (t,)
    parts = [h.chunk(world, dim)[rank] for h in halves]
    return torch.cat(parts, dim).contiguous()


def add_row_bias(out: torch.Tensor, b2: torch.Tensor | None, counts) -> torch.Tensor:
    """``out [N, H]`` grouped by expert with ``counts`` [E] rows each, plus each row's expert
    bias ``b2 [E, H]`` (device ops; no host read of a counts tensor)."""
    if b2 is None:
        return out
    counts = torch.as_tensor(counts, dtype=torch.int64, device=out.device)
    experts = torch.arange(b2.shape[0], device=out.device)
    return out + b2.index_select(0, torch.repeat_interleave(experts, counts, output_size=len(out)))
