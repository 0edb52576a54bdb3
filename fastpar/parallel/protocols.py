"""What a data-parallel wrapper provides to the code that drives its gradient reduction (the
pipeline engine, a training loop): ``GradSync``, runtime-checkable, so callers ask
``isinstance(stage, GradSync)`` instead of probing for methods."""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable


@runtime_checkable
class GradSync(Protocol):
    """``no_sync()``: backward passes inside accumulate gradients without communicating (all
    micro-batches but the last); ``finish_grad_sync()``: after the last backward of a step —
    once every pipeline stage is done — wait for the reductions in flight and finish what needs
    every stage (the gradient sum of parameters tied across stages)."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def finish_grad_sync(self) -> None: ...
