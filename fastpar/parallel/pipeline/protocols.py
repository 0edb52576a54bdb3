"""What a module inside a stage may declare for the pipeline, which asks ``module.modules()`` for
it instead of naming the class (``fastpar.moe.MoE`` implements both; nothing here imports it):
``ForwardState`` (``keep_forward_state()``: a recomputation puts back what the forward left on
the module) and ``AuxLoss`` (``aux_loss_weight(scale)``: the auxiliary loss weighed like the
main loss), docs/pipelines.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ForwardState(Protocol):
    def keep_forward_state(self) -> contextlib.AbstractContextManager[None]: ...


@runtime_checkable
class AuxLoss(Protocol):
    def aux_loss_weight(
        self, scale: float | torch.Tensor | None
    ) -> contextlib.AbstractContextManager[None]: ...


def keeping_state(module: nn.Module) -> list[nn.Module]:
    """The modules among ``module`` and its sub-modules that keep a forward's state
    (``ForwardState``), in ``modules()`` order."""
    return [m for m in module.modules() if callable(getattr(m, "keep_forward_state", None))]


@contextlib.contextmanager
def forward_state_kept(modules: Iterable[nn.Module]):
    """Every module's ``keep_forward_state()`` entered, in order."""
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(m.keep_forward_state())
        yield


def aux_loss_hooks(modules: Iterable[nn.Module]) -> list:
    """The distinct ``aux_loss_weight`` hooks (``AuxLoss``) of ``modules`` and their
    sub-modules, in order: found once, entered every step (``aux_loss_weighed``)."""
    hooks = (getattr(m, "aux_loss_weight", None) for c in modules for m in c.modules())
    return list(dict.fromkeys(h for h in hooks if callable(h)))


@contextlib.contextmanager
def aux_loss_weighed(hooks: Iterable, scale: float | torch.Tensor | None):
    """Each of ``hooks`` (``aux_loss_hooks``) entered with ``scale``."""
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook(scale))
        yield
