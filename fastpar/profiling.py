"""Named ranges around each pipeline stage's forward and backward per micro-batch, every
collective and the optimizer step: an NVTX range on a CUDA build with a GPU (nsys timelines)
and a ``torch.profiler.record_function`` range while a torch profiler records (so they show in
``python -m fastpar.train --profile`` traces on any device, CPUs included). Nothing at all when
neither applies, and nothing inside a region ``torch.compile`` traces.

    nsys profile -t cuda,nvtx -o fastpar torchrun --nproc-per-node 8 -m fastpar.train ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ENABLED = torch.cuda.is_available()


@contextlib.contextmanager
def nvtx(name: str) -> Iterator[None]:
    """``with nvtx("forward mb3"):`` — an NVTX range on CUDA builds with a GPU, and a
    ``record_function`` range while a torch profiler is active; else nothing."""
    if torch.compiler.is_compiling():
        yield
        return
    record = torch.autograd._profiler_enabled()
    if not (_ENABLED or record):
        yield
        return
    with contextlib.ExitStack() as stack:
        if record:
            stack.enter_context(torch.profiler.record_function(name))
        if _ENABLED:
            torch.cuda.nvtx.range_push(name)
            stack.callback(torch.cuda.nvtx.range_pop)
        yield
