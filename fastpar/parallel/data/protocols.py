"""What a data-parallel wrapper provides, as runtime-checkable protocols, so callers (the
pipeline engine, the trainer, a checkpoint) ask ``isinstance(x, GradSync)`` instead of naming
a class or probing for methods: ``GradSync`` (what the code driving backward needs) and
``DataParallel`` (a whole member of the family: ``Replicate``, ``Shard``, and the historical
``DistributedDataParallel``, ``ZeroOptimizer``, ``Zero3`` that wrap them)."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

from fastpar.amp.protocols import AmpOptimizer
from fastpar.optim.pieces import CheckpointPieces


@runtime_checkable
class GradSync(Protocol):
    """``no_sync()``: backward passes inside accumulate gradients without communicating (all
    micro-batches but the last); ``finish_grad_sync()``: after the last backward of a step —
    once every pipeline stage is done — wait for the reductions in flight and finish what needs
    every stage (the gradient sum of parameters tied across stages). Optional:
    ``defers_reduction_in_no_sync`` (bool), true when backward passes inside ``no_sync()``
    neither reduce nor check anything at their end, so one may be split into several engine
    calls (the pipeline's zero-bubble W pass does so only then)."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def finish_grad_sync(self) -> None: ...


@runtime_checkable
class DataParallel(GradSync, AmpOptimizer, CheckpointPieces, Protocol):
    """One data-parallel wrapper, whatever its ZeRO ``stage`` (0: replicated):

    * ``zero_grad(set_to_none=True)``: the next backward accumulates from zero (the buffers are
      reused; ``set_to_none`` changes nothing at any stage);
    * ``step() -> (skipped, grad_norm)``: 0-dim device tensors, no host sync;
    * ``comm_bytes``: payload bytes this rank sent (a number, ring model);
    * ``memory_bytes()``: bytes held now, {"params", "grads", "masters", "optimizer", "total"};
    * ``state_dict()`` / ``load_state_dict(state)``: this rank's state, same layout only;
    * ``summon_full_params()``: a context in which the parameters hold full values (ZeRO-3
      gathers them; a no-op below);
    * ``module``: the wrapped module (None for an optimizer-shaped wrapper, ``ZeroOptimizer``).
    """

    stage: int
    module: Any

    @property
    def comm_bytes(self) -> float: ...

    def memory_bytes(self) -> dict[str, int]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def summon_full_params(self) -> contextlib.AbstractContextManager[None]: ...
