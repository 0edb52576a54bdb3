"""NVTX ranges for nsys timelines: named ranges around each pipeline stage's forward and
backward per micro-batch, every collective and the optimizer step. No-ops without CUDA.

    nsys profile -t cuda,nvtx -o fastpar torchrun --nproc-per-node 8 -m fastpar.train ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ENABLED = torch.cuda.is_available()


@contextlib.contextmanager
def nvtx(name: str) -> Iterator[None]:
    """``with nvtx("forward mb3"):`` — an NVTX range on CUDA builds with a GPU, else nothing."""
    if not _ENABLED:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
