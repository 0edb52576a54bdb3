"""Tensor parallelism inside ``MoE``: expert tensor parallelism (ETP) and sequence parallelism.

Three layouts at TP = t > 1 (the mesh's tensor-parallel group, which is also the expert grid's
expert-TP group: ``fastpar.mesh.layout``):

* **replicated** (the default): every TP rank holds the same tokens and every expert in
  full, and computes the same thing (redundantly). Gradients need no TP communication.
* **expert TP** (``expert_tp=True``): each expert's FFN is split like a Megatron MLP — ``w1``
  by columns (gate and up halves each split, so a rank holds ``[gate_r | up_r]``,
  [E_local, H, 2F/t]), ``b1`` alike, ``w2`` by rows ([E_local, F/t, H]); ``b2`` replicated.
  The rows entering the experts pass ``copy_to_region`` (their gradient is all-reduced), the
  second matmul's partial sums are all-reduced (``reduce_from_region``), then ``b2`` is added
  once. Routing, permutation and the EP all-to-alls see the same tokens on every TP rank.
  Under sequence parallelism the layer first all-gathers the sequence over TP
  (``gather_from_sequence``: backward keeps this rank's chunk, whose gradient is complete)
  and hands back this rank's chunk at the end (``scatter_to_sequence``). The cost beside
  Megatron-Core's dispatcher (which routes the local chunk and all-gathers only the rows
  that reach each expert): routing and the all-to-alls process the whole sequence on every
  TP rank (t× the all-to-all volume).
* **sequence-parallel tokens** (``sequence_parallel=True``, experts not split): each TP rank
  routes only its own chunk of the sequence (tokens split over TP, not replicated); the
  experts are full copies on every TP rank. Every parameter of the layer then sees only this
  rank's tokens, so its gradient is all-reduced over TP (``all_reduce_grad``, before
  accumulation), and the router's load-balancing statistics and z-loss are summed over TP
  (``fastpar.moe.balance``) so the aux loss equals the single-process one over the whole
  sequence. Capacity mode is refused here: a per-chunk capacity drops other tokens than the
  single-process layer does. Expert-bias counts are summed over TP by ``update_expert_bias``.
"""

from __future__ import annotations

import torch


def layout_of(tp: int, sequence_parallel: bool, expert_tp: bool) -> str:
    """Which layout ("replicated", "expert_tp" or "sequence", module docstring) a layer with
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
