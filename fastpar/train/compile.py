"""``--compile``: each block of this rank's pipeline stage under ``torch.compile``.

Each block's ``forward`` is compiled in place (``torch.compile(block.forward)``), the way
torchtitan compiles per transformer block: the module tree, the parameter names (checkpoints),
the data-parallel wrapper's hooks and ZeRO-3's per-block gathers stay as they are and run
eagerly around the compiled forward; activation recompute and the pipeline engine call the
block as before. The first step of each rank compiles (inductor: C++ on CPUs, Triton on GPUs),
so it is slow; the later ones reuse the code. fastpar's named ranges (``fastpar.profiling``) are
left out of compiled code; collectives inside a block (tensor parallelism, MoE all-to-all) are
traced by dynamo or split the graph there.

MoE layers: the weight of their auxiliary loss that a pipeline engine sets around its forwards
(``fastpar.moe.layer.aux_loss_scale``, a context variable) is not seen inside a compiled
forward (dynamo traces the MoE without it, so the auxiliary loss's gradient is lost). A block
with MoE layers therefore reads it eagerly before the compiled forward and hands it to its
layers as their own ``aux_loss_scale`` for that call, the attribute path compiled code sees.
"""

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
