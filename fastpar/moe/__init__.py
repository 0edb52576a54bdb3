"""Mixture of experts: top-k routers with capacity and the expert-parallel MoE layer.

``set_transport("python" | "extension" | None)``: which all-to-all the overlapped layer
(``overlap_chunks > 1``) uses (``FASTPAR_MOE_TRANSPORT``'s API; ``transport()`` says which runs).
"""

from __future__ import annotations

from fastpar.moe.layer import MoE, moe_aux_loss
from fastpar.moe.overlap import set_transport, transport
from fastpar.moe.router import Routing, TopKRouter, capacity_for

__all__ = [
    "MoE",
    "Routing",
    "TopKRouter",
    "capacity_for",
    "moe_aux_loss",
    "set_transport",
    "transport",
]
