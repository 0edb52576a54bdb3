"""Pipeline parallelism: stage partitioning (contiguous, or round-robin model chunks), GPipe
(with recomputation: the whole stage, or selectively per block, ``recompute``), 1F1B, interleaved 1F1B (virtual stages), zero-bubble ZB-H1 (backward split into input and weight
gradients) and forward-only (evaluation)
schedules — schedules are data, one engine runs them all. Stage messages are a tensor or a
tuple of tensors; ``fastpar.parallel.pipeline.hf`` turns a Hugging Face causal LM into
pipeline blocks (transformers is imported only there)."""

from __future__ import annotations

from fastpar.parallel.pipeline.engine import PipelineEngine, tie_across_stages
from fastpar.parallel.pipeline.p2p import P2P
from fastpar.parallel.pipeline.partition import (
    VirtualStages,
    block_costs,
    build_stage,
    build_virtual_stages,
    partition,
)
from fastpar.parallel.pipeline.recompute import RecomputePolicy, apply_recompute, checkpoint_module
from fastpar.parallel.pipeline.schedules import (
    SCHEDULES,
    ForwardOnly,
    GPipe,
    Interleaved,
    OneFOneB,
    Schedule,
    ZeroBubbleH1,
    make_schedule,
)

__all__ = [
    "P2P",
    "SCHEDULES",
    "ForwardOnly",
    "GPipe",
    "Interleaved",
    "OneFOneB",
    "PipelineEngine",
    "RecomputePolicy",
    "Schedule",
    "VirtualStages",
    "ZeroBubbleH1",
    "apply_recompute",
    "block_costs",
    "build_stage",
    "build_virtual_stages",
    "checkpoint_module",
    "make_schedule",
    "partition",
    "tie_across_stages",
]
