"""What optimizers declare to the mixed-precision step and to the code that drives them:
``FusedAmpStep``, ``FoldedAmpStep`` and ``AmpOptimizer``, all ``runtime_checkable``
(docs/layouts.md, "Mixed precision")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class FusedAmpStep(Protocol):
    """``amp_step(found_inf=, inv_scale=, clip_coef=)``: one update of every parameter with a
    gradient, where each argument is a 0-dim device tensor or None (not applied): a nonzero
    ``found_inf`` skips the whole update on the device (step counts do not advance); gradients
    are multiplied by ``inv_scale``, then by ``clip_coef``. Nothing is read from or left on the
    optimizer's attributes."""

    def amp_step(
        self,
        *,
        found_inf: torch.Tensor | None = None,
        inv_scale: torch.Tensor | None = None,
        clip_coef: torch.Tensor | None = None,
    ) -> None: ...


@runtime_checkable
class FoldedAmpStep(FusedAmpStep, Protocol):
    """A ``FusedAmpStep`` that declares ``amp_step_takes_grads = True``: ``amp_step`` also takes
    ``grads``, a mapping from a parameter of the optimizer to the gradient to use for it (any
    float dtype, the parameter's shape; still loss-scaled) in place of its ``.grad``."""

    amp_step_takes_grads: bool

    def amp_step(
        self,
        *,
        found_inf: torch.Tensor | None = None,
        inv_scale: torch.Tensor | None = None,
        clip_coef: torch.Tensor | None = None,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None: ...


def takes_grads(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``FoldedAmpStep`` (declared, not only shaped like one)."""
    return isinstance(optimizer, FoldedAmpStep) and optimizer.amp_step_takes_grads is True


@runtime_checkable
class AmpOptimizer(Protocol):
    """An optimizer wrapper as a training loop drives it: ``scale_loss(loss).backward()``,
    ``skipped, grad_norm = step()`` (0-dim device tensors: no host sync), ``zero_grad()``;
    ``scaler`` (a loss scaler or None) and ``skipped_steps`` (a device tensor) are what a
    checkpoint saves with it."""

    scaler: Any

    @property
    def skipped_steps(self) -> torch.Tensor: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def step(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
