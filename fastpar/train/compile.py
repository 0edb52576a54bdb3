"""``--compile``: each block of this rank's pipeline stage under ``torch.compile``, compiled in
place so names, hooks and gathers stay eager around it; MoE blocks read the aux-loss weight
eagerly first (docs/training.md, "Inside fastpar.train")."""

from __future__ import annotations

import functools

import torch
from torch import nn

from fastpar.moe import MoE, moe_layers
from fastpar.moe.layer import current_aux_loss_scale


def _with_aux_scale(compiled, moes: list[MoE]):
    """``compiled`` with the engine's auxiliary-loss weight handed to ``moes`` for the call."""

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        scale, unset = current_aux_loss_scale(), [m for m in moes if m.aux_loss_scale is None]
        if scale is None or not unset:
            return compiled(*args, **kwargs)
        for m in unset:
            m.aux_loss_scale = scale
        try:
            return compiled(*args, **kwargs)
        finally:
            for m in unset:
                m.aux_loss_scale = None

    return forward


def compile_blocks(stage: nn.Module, **options) -> list[nn.Module]:
    """Compile the ``forward`` of each block (child) of ``stage`` (an ``nn.Sequential``, or one
    module: itself). ``options``: ``torch.compile``'s (default: the inductor backend). Returns
    the blocks compiled. Idempotent."""
    blocks = list(stage.children()) if isinstance(stage, nn.Sequential) else [stage]
    done = []
    for block in blocks:
        if getattr(block, "_fastpar_compiled", False):
            continue
        compiled = torch.compile(block.forward, **options)
        moes = moe_layers(block)
        block.forward = _with_aux_scale(compiled, moes) if moes else compiled
        block._fastpar_compiled = True
        done.append(block)
    return done
