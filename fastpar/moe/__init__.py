"""Mixture of experts: top-k routers with capacity and the expert-parallel MoE layer."""

from __future__ import annotations

from fastpar.moe.layer import MoE, moe_aux_loss
from fastpar.moe.router import Routing, TopKRouter, capacity_for

__all__ = ["MoE", "Routing", "TopKRouter", "capacity_for", "moe_aux_loss"]
