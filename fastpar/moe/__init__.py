"""Mixture of experts: top-k routers with capacity and the expert-parallel MoE layer.

``update_expert_bias(model, group)``: the aux-loss-free balancing step of every router of
``model`` built with ``expert_bias=True`` (once per optimizer step; ``group``: the
data-parallel group).

``set_transport("python" | "extension" | None)``: which all-to-all the overlapped layer
(``overlap_chunks > 1``) uses (``FASTPAR_MOE_TRANSPORT``'s API; ``transport()`` says which runs).

``moe_from_hf(block, mesh=)`` / ``moe_to_hf_state_dict(moe)``: Hugging Face Mixtral, Qwen2/3-MoE
and DeepSeek-V3 MoE blocks into ``MoE`` (same outputs and gradients) and back with HF's names
(``fastpar.moe.hf``; transformers is never imported).
"""

from __future__ import annotations

from torch import nn

from fastpar.moe.balance import update_expert_bias
from fastpar.moe.hf import moe_from_hf, moe_to_hf_state_dict
from fastpar.moe.layer import MoE, moe_aux_loss
from fastpar.moe.overlap import set_transport, transport
from fastpar.moe.router import Routing, TopKRouter, capacity_for

__all__ = [
    "MoE",
    "Routing",
    "TopKRouter",
    "capacity_for",
    "moe_aux_loss",
    "moe_from_hf",
    "moe_layers",
    "moe_to_hf_state_dict",
    "set_transport",
    "transport",
    "update_expert_bias",
]


def moe_layers(module: nn.Module) -> list[MoE]:
    """The routed-expert layers (``MoE``) among ``module`` and its sub-modules, in
    ``modules()`` order: what code outside this package asks instead of testing types."""
    return [m for m in module.modules() if isinstance(m, MoE)]
