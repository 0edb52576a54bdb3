"""Pipeline parallelism: stage partitioning, GPipe (with recomputation) and 1F1B schedules.
Stage messages are a tensor or a tuple of tensors; ``fastpar.parallel.pipeline.hf`` turns a
Hugging Face causal LM into pipeline blocks (transformers is imported only there)."""

from __future__ import annotations

from fastpar.parallel.pipeline.engine import PipelineEngine, tie_across_stages
from fastpar.parallel.pipeline.p2p import P2P
from fastpar.parallel.pipeline.partition import block_costs, build_stage, partition
from fastpar.parallel.pipeline.schedules import GPipe, OneFOneB, Schedule

__all__ = [
    "P2P",
    "GPipe",
    "OneFOneB",
    "PipelineEngine",
    "Schedule",
    "block_costs",
    "build_stage",
    "partition",
    "tie_across_stages",
]
