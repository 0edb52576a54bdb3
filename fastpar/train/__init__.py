"""``python -m fastpar.train``: train a GPT or a Llama with DP x TP x PP x EP, ZeRO and mixed precision.

    python -m fastpar.train                                   # defaults: 8 CPU ranks, every parallelism
    python -m fastpar.train --tp 2 --pp 2 --dp 2 --zero 1 --precision bf16 --steps 100
    python -m fastpar.train --model llama --kv-heads 2 --qk-norm --tokenizer tok.json --data my.txt
    torchrun --nproc-per-node 8 -m fastpar.train --tp 2 --pp 2 --ep 2   # under torchrun: its ranks

Without torchrun it starts the ranks itself on this machine (tp·pp·dp of them; gloo on CPUs,
NCCL on GPUs). Models: ``--model gpt`` (default) or ``llama`` (``fastpar.models.llama``: GQA,
RoPE, SwiGLU, optional Qwen3 q/k-norm and Qwen2 q/k/v bias). Data (``fastpar.data``):
``--data`` a text file (its bytes, or its ids under ``--tokenizer tokenizer.json``, which also
sets the vocabulary size), a ``.npy`` array or a memory-mapped ``.bin`` file of token ids
(``--data-dtype`` uint16 / uint32); else an embedded corpus: text that ships with Python itself.
Every token id is checked against the vocabulary before any rank starts. Every step is
deterministic given the seed: the same batch at the same step on any layout, which is what
``python -m fastpar.verify`` relies on. Steps between logged steps (``--log-every N``) and save
steps make no host sync.

Components, one module each: ``config`` (``TrainConfig``, the parser), ``checks`` (every flag's
range, the world size under torchrun), ``memory`` (activations against this machine),
``batches`` (data, the batch of a step, the learning rate), ``build`` (the model's blocks,
parameter groups, loss scaler, data-parallel wrapper and optimizer for a mesh, or for none:
``fastpar.verify``'s single-process reference is built by the same code; ``Trainer``), ``loop``
(``run``: steps and sync points), ``metrics`` (numbers read at sync points, progress,
MFU with attention FLOPs, the JSONL / TensorBoard records),
``stop`` (preemption and divergence, alike on every rank), ``checkpointing`` (the checkpoint
directory, each checkpoint with its resolved settings), ``compile`` (``--compile``: each block
under ``torch.compile``), ``peers`` (stopped torchrun siblings), ``launch`` (torchrun's ranks,
or ranks started by ``fastpar.launch.run_ranks``), ``cli`` (the command: its flags and
``--config FILE``).
"""

from __future__ import annotations

from fastpar.train.batches import batch_of, load_data, lr_at
from fastpar.train.build import Parts, Trainer
from fastpar.train.checkpointing import latest_checkpoint
from fastpar.train.cli import build_parser, main
from fastpar.train.config import COLLECTIVE_TIMEOUT_S, TrainConfig, config_from
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
