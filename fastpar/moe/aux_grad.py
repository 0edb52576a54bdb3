"""How an ``MoE`` layer's auxiliary loss enters backward without joining the loss: the
``aux_loss_scale(...)`` block a pipeline engine opens around its forwards, and the autograd
function that sends the scaled gradient of the aux loss with the layer's output."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_UNSET = object()
_AUX_LOSS_SCALE: contextvars.ContextVar = contextvars.ContextVar(
    "fastpar_moe_aux_loss_scale", default=_UNSET
)


@contextlib.contextmanager
def aux_loss_scale(scale: float | torch.Tensor | None) -> Iterator[None]:
    """Inside the block, every ``MoE`` whose own ``aux_loss_scale`` is None sends its auxiliary loss
    into backward scaled by ``scale`` (None: not at all), as if ``scale · aux_loss`` were added to
    the loss. What a pipeline engine sets around its forwards: the weight of one micro-batch's loss
    (1 / micro-batches, times the loss scale), so no stage needs the final loss. Forwards read it; a
    scale tensor is read again by the backward, so keep it unchanged until then."""
    token = _AUX_LOSS_SCALE.set(scale)
    try:
        yield
    finally:
        _AUX_LOSS_SCALE.reset(token)


def current_aux_loss_scale() -> float | torch.Tensor | None:
    """The weight ``aux_loss_scale(...)`` set around this forward (None outside one, or inside
    ``aux_loss_scale(None)``). A compiled forward cannot read it (dynamo does not trace context
    variables): code that compiles a block reads it eagerly and sets it on the layers as their
    own ``aux_loss_scale`` for the call (``fastpar.train.compile``)."""
    return block_scale(None)


def block_scale(outside):
    """The weight of the innermost ``aux_loss_scale(...)`` block around this forward (None
    inside ``aux_loss_scale(None)``); ``outside`` where no block is open."""
    scale = _AUX_LOSS_SCALE.get()
    return outside if scale is _UNSET else scale


class InjectAuxGrad(torch.autograd.Function):
    """Identity on ``y``; in backward, also sends ``scale`` as the gradient of ``aux_loss``."""

    @staticmethod
    def forward(ctx, y, aux_loss, scale):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        scale = torch.as_tensor(ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, scale.expand(ctx.aux_shape).clone(), None
