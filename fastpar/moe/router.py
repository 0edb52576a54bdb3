"""Top-k routers with capacity: Switch (k = 1), GShard (k = 2), top-k in general.

The gate is a linear layer computed in fp32 (logits [T, E], softmax in fp32). Each token picks
its k most probable experts. Capacity per expert C = max(min_capacity, ceil(k·T/E·factor)), or
dropless (``capacity_factor=None``). Which pairs an over-full expert keeps is the drop policy:

* "position": the earliest tokens, every token's first choice before any second choice
  (GShard);
* "probs": the most probable (token, choice) pairs first.

Combine weights are the chosen probabilities, renormalised over the choices a token keeps
(``normalize_topk``, default: when k > 1; Switch keeps the raw top-1 probability).

Auxiliary losses (0-dim, differentiable):

* load balancing ``aux_loss_coef · E · Σ_i f_i · P_i`` — f_i the fraction of the T·k routing
  choices sent to expert i (before capacity), P_i the mean router probability of expert i. It is
  1·coef at perfect balance and E·coef when everything goes to one expert. For k = 1 this is the
  Switch Transformer loss. Conventions differ: DeepSpeed's top-2 gate uses the first choices only
  for f_i (same E·Σ scale); the GShard paper's formula averages over experts instead of summing
  and has no factor E, i.e. it is this loss divided by E² (so its coefficient must be E² larger).
* router z-loss ``z_loss_coef · mean_t(logsumexp(logits_t)²)`` (ST-MoE).

Optional multiplicative input jitter (Switch) in training. Everything stays on the device.

Hugging Face's Llama-class MoE routers, side by side: Mixtral and Qwen3-MoE take the softmax
over all experts in fp32, then top-k, drop nothing, and renormalise the k weights (Mixtral
always, Qwen3-MoE when ``norm_topk_prob``) — this router in dropless mode
(``capacity_factor=None``) with ``normalize_topk`` set alike. In fp32 the two compute the same
numbers. In bf16 / fp16 they round differently: HF computes the gate logits in the activations'
dtype (this router in fp32) and Qwen3-MoE casts the weights back to it before combining
(fastpar combines in fp32). Their load-balancing loss (only with ``output_router_logits``) is
k times this one's, over all layers' tokens pooled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DROP_POLICIES = ("position", "probs")


@dataclass
class Routing:
    """A router's decision for T tokens.

    ``expert_ids [T, k]`` int64, ``probs [T, k]`` fp32 chosen probabilities (not yet renormalised),
    ``order`` [T·k] processing order of the choice-major pairs for the "probs" policy (None:
    natural order), ``capacity`` C or None, ``router_probs [T, E]`` fp32, ``logits [T, E]``.
    """

    expert_ids: torch.Tensor
    probs: torch.Tensor
    order: torch.Tensor | None
    capacity: int | None
    router_probs: torch.Tensor
    logits: torch.Tensor


def capacity_for(
    num_tokens: int, num_experts: int, top_k: int, factor: float | None, minimum: int
) -> int | None:
    """C = max(minimum, ceil(k · T / E · factor)); None when ``factor`` is None (dropless)."""
    if factor is None:
        return None
    return max(minimum, math.ceil(top_k * num_tokens / num_experts * factor))


class TopKRouter(nn.Module):
    """Linear gate [E, H] in fp32 and top-k choice. ``forward(x [T, H]) -> Routing``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        *,
        capacity_factor: float | None = 1.25,
        min_capacity: int = 4,
        drop_policy: str = "position",
        normalize_topk: bool | None = None,
        aux_loss_coef: float = 1e-2,
        z_loss_coef: float = 0.0,
        jitter: float = 0.0,
        device=None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"capacity_factor must be positive or None (dropless), got {capacity_factor}"
            )
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
        if min_capacity < 1:
            raise ValueError(f"min_capacity must be >= 1, got {min_capacity}")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.drop_policy = drop_policy
        self.normalize_topk = top_k > 1 if normalize_topk is None else normalize_topk
        self.aux_loss_coef, self.z_loss_coef, self.jitter = aux_loss_coef, z_loss_coef, jitter
        gate = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=torch.float32)
        self.weight = nn.Parameter(gate.weight.detach())

    def forward(self, x: torch.Tensor) -> Routing:
        if x.dim() != 2:
            raise ValueError(f"router expects tokens [T, H], got {tuple(x.shape)}")
        h = x.float()
        if self.training and self.jitter > 0:
            noise = torch.empty_like(h).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            h = h * noise
        logits = F.linear(h, self.weight.float())
        router_probs = torch.softmax(logits, dim=-1)
        probs, ids = torch.topk(router_probs, self.top_k, dim=-1)
        t = x.shape[0]
        order = None
        if self.drop_policy == "probs":
            flat = probs.t().reshape(-1)  # choice-major pairs j·T + t
            order = torch.sort(flat, descending=True, stable=True).indices
        capacity = capacity_for(
            t, self.num_experts, self.top_k, self.capacity_factor, self.min_capacity
        )
        return Routing(ids, probs, order, capacity, router_probs, logits)

    def combine_weights(self, routing: Routing, slots: torch.Tensor) -> torch.Tensor:
        """[T, k] weights of each kept choice (dropped choices weigh 0)."""
        kept = (slots >= 0).to(routing.probs.dtype)
        w = routing.probs * kept
        if self.normalize_topk:
            w = w / w.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
        return w

    def aux_losses(
        self, routing: Routing, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss), both already multiplied by their coefficients."""
        t = routing.router_probs.shape[0]
        f = counts.to(torch.float32) / max(1, t * self.top_k)
        p = routing.router_probs.mean(dim=0)
        balance = self.aux_loss_coef * self.num_experts * (f * p).sum()
        z = self.z_loss_coef * torch.logsumexp(routing.logits, dim=-1).square().mean()
        return balance, z
