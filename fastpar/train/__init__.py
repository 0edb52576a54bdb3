"""``python -m fastpar.train``: train a GPT or a Llama with DP x TP x PP x EP, ZeRO and mixed precision.

    python -m fastpar.train                                   # defaults: 8 CPU ranks, every parallelism
    python -m fastpar.train --tp 2 --pp 2 --dp 2 --zero 1 --precision bf16 --steps 100
    torchrun --nproc-per-node 8 -m fastpar.train --tp 2 --pp 2 --ep 2   # under torchrun: its ranks

The flags and data: docs/training.md; its modules and one step's flow: docs/architecture.md."""

from __future__ import annotations

from fastpar.checkpoint.directory import latest_checkpoint
from fastpar.train.batches import batch_of, load_data, lr_at
from fastpar.train.build import Parts, Trainer
from fastpar.train.checks import COLLECTIVE_TIMEOUT_S
from fastpar.train.cli import build_parser, main
from fastpar.train.config import TrainConfig, config_from
from fastpar.train.launch import launch
from fastpar.train.loop import run
from fastpar.train.stop import RunStopped

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "Parts",
    "RunStopped",
    "TrainConfig",
    "Trainer",
    "batch_of",
    "build_parser",
    "config_from",
    "latest_checkpoint",
    "launch",
    "load_data",
    "lr_at",
    "main",
    "run",
]
