"""Mixture of experts: top-k routers with capacity and the expert-parallel MoE layer (docs/moe.md).

``update_expert_bias(model, group)``: the aux-loss-free balancing step of every router built
with ``expert_bias=True``, once per optimizer step. ``set_transport("python" | "extension" |
None)``: the overlapped layer's all-to-all. ``moe_from_hf`` / ``moe_to_hf_state_dict``: Hugging
Face MoE blocks both ways."""

from __future__ import annotations

from torch import nn

from fastpar.moe.balance import update_expert_bias
from fastpar.moe.config import SCORES, ExpertConfig, RouterConfig
from fastpar.moe.hf import moe_from_hf, moe_to_hf_state_dict
from fastpar.moe.layer import MoE, moe_aux_loss
from fastpar.moe.overlap import set_transport, transport
from fastpar.moe.router import Routing, TopKRouter, capacity_for

__all__ = [
    "SCORES",
    "ExpertConfig",
    "MoE",
    "RouterConfig",
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
