"""Top-k routers with capacity: Switch (k = 1), GShard (k = 2), DeepSeek-V3, top-k in general.

Scores (softmax / sigmoid), selection, capacity and drop policies, combine weights, the
auxiliary losses and aux-loss-free balancing, and the defaults beside Megatron-Core's and
Hugging Face's: docs/moe.md ("Routing"). Everything stays on the device."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastpar.moe import balance
from fastpar.moe.config import SCORES, RouterConfig
from fastpar.reference.precision import upcast


@dataclass
class Routing:
    """A router's decision for T tokens.

    ``expert_ids [T, k]`` int64, ``probs [T, k]`` fp32 chosen scores (unbiased, not yet
    renormalised), ``order`` [T·k] processing order of the choice-major pairs for the "probs" /
    "weights" policies (None: natural order), ``capacity`` C or None, ``router_probs [T, E]``
    fp32 scores (softmax probabilities or sigmoid scores), ``logits [T, E]``, ``seq_len``: the
    tokens per sequence the forward was told (None: unknown), ``valid [T]`` bool: the tokens
    the statistics count (None: all; module docstring).
    """

    expert_ids: torch.Tensor
    probs: torch.Tensor
    order: torch.Tensor | None
    capacity: int | None
    router_probs: torch.Tensor
    logits: torch.Tensor
    seq_len: int | None = None
    valid: torch.Tensor | None = None


def capacity_for(
    num_tokens: int, num_experts: int, top_k: int, factor: float | None, minimum: int | None
) -> int | None:
    """C = max(minimum, ceil(k · T / E · factor)); None when ``factor`` is None (dropless);
    ``minimum`` None or 0: no minimum (Megatron)."""
    if factor is None:
        return None
    return max(minimum or 0, math.ceil(top_k * num_tokens / num_experts * factor))


class TopKRouter(nn.Module):
    """Linear gate [E, H] in fp32 and top-k choice. ``forward(x [T, H], seq_len=None,
    valid=None) -> Routing`` (``seq_len``: tokens per sequence, batch-first; needed by
    ``aux_loss="sequence"``; ``valid [T]`` bool: the tokens the aux losses and expert-bias
    counts count, module docstring).

    Options: ``router=RouterConfig(...)`` (``fastpar.moe.config`` documents every field),
    and/or its fields as keywords (``score="sigmoid"``, ``expert_bias=True``, ...), which
    replace the ``router``'s. ``config``: the resulting ``RouterConfig``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        *,
        router: RouterConfig | None = None,
        device=None,
        **options,
    ) -> None:
        super().__init__()
        cfg = dataclasses.replace(router or RouterConfig(), **options)
        self.group_score_topk = cfg.check(num_experts, top_k)
        self.config = cfg
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.drop_policy = cfg.capacity_factor, cfg.drop_policy
        self.normalize_topk = top_k > 1 if cfg.normalize_topk is None else cfg.normalize_topk
        self.score, self.scaling_factor = cfg.score, cfg.scaling_factor
        self.num_groups, self.group_topk = cfg.num_groups, cfg.group_topk
        self.bias_update_rate, self.aux_loss = cfg.bias_update_rate, cfg.aux_loss
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        # the TP group this router's tokens are split over (a sequence-parallel MoE sets it:
        # ``fastpar.moe.tp``); its aux statistics and expert-bias counts are summed over it
        self.token_group: dist.ProcessGroup | None = None
        gate = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=torch.float32)
        self.weight = nn.Parameter(gate.weight.detach())
        if cfg.expert_bias:
            zeros = torch.zeros(num_experts, dtype=torch.float32, device=device)
            self.register_buffer("expert_bias", zeros)
            counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
            self.register_buffer("tokens_per_expert", counts, persistent=False)
        else:
            self.expert_bias = None

    def forward(
        self, x: torch.Tensor, seq_len: int | None = None, valid: torch.Tensor | None = None
    ) -> Routing:
        if x.dim() != 2:
            raise ValueError(f"router expects tokens [T, H], got {tuple(x.shape)}")
        if valid is not None:
            valid = _check_valid(valid, x.shape[0], x.device)
        h = upcast(x)  # fp32 (float64 for the exact reference)
        if self.training and self.config.jitter > 0:
            noise = torch.empty_like(h).uniform_(1.0 - self.config.jitter, 1.0 + self.config.jitter)
            h = h * noise
        logits = F.linear(h, self.weight.to(h.dtype))
        router_probs = SCORES[self.score].probs(logits)
        if self.expert_bias is None and self.num_groups is None:
            probs, ids = torch.topk(router_probs, self.top_k, dim=-1)
        else:
            ids = self._select(router_probs)
            probs = router_probs.gather(1, ids)
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                flat = ids.reshape(-1)
                ones = (
                    torch.ones_like(flat)
                    if valid is None
                    else valid.repeat_interleave(self.top_k).to(flat.dtype)
                )  # token-major, like ids.reshape(-1): valid tokens only
                self.tokens_per_expert.index_add_(0, flat, ones)
        t = x.shape[0]
        order = None
        if self.drop_policy != "position":
            ranked = probs if self.drop_policy == "probs" else self._topk_weights(probs)
            flat = ranked.t().reshape(-1)  # choice-major pairs j·T + t
            order = torch.sort(flat, descending=True, stable=True).indices
        capacity = capacity_for(
            t, self.num_experts, self.top_k, self.capacity_factor, self.config.min_capacity
        )
        return Routing(ids, probs, order, capacity, router_probs, logits, seq_len, valid)

    def _select(self, router_probs: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k] by the selection scores: the scores plus the expert bias, top-k
        inside each token's best groups when group-limited."""
        sel = router_probs.detach()
        if self.expert_bias is not None:
            sel = sel + self.expert_bias.to(sel.dtype)
        if self.num_groups is None:
            return torch.topk(sel, self.top_k, dim=-1).indices
        return balance.group_limited_topk(
            sel, self.top_k, self.num_groups, self.group_topk, self.group_score_topk
        )

    def _topk_weights(self, probs: torch.Tensor) -> torch.Tensor:
        """Pre-drop combine weights [T, k]: renormalised over the k choices (when
        ``normalize_topk``), times ``scaling_factor``."""
        w = probs
        if self.normalize_topk:
            w = w / w.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
        if self.scaling_factor is not None:
            w = w * self.scaling_factor
        return w

    def combine_weights(self, routing: Routing, slots: torch.Tensor) -> torch.Tensor:
        """[T, k] weights of each kept choice (dropped choices weigh 0)."""
        kept = (slots >= 0).to(routing.probs.dtype)
        if self.config.drop_weights == "keep":
            return self._topk_weights(routing.probs) * kept
        return self._topk_weights(routing.probs * kept)

    def aux_losses(
        self, routing: Routing, counts: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss), both already multiplied by their coefficients.
        ``counts [E]``: the routing choices per expert before capacity (micro-batch loss), of
        every token. ``valid [T]`` bool (None: ``routing.valid``): over the valid tokens only
        (module docstring; their choices are counted here from ``routing.expert_ids``)."""
        p = balance.balance_scores(routing.router_probs, self.score)
        group = self.token_group
        valid = routing.valid if valid is None else _check_valid(valid, p.shape[0], p.device)
        if self.aux_loss == "micro_batch":
            if valid is not None:
                counts = balance.valid_counts(routing.expert_ids, valid, self.num_experts)
            bal = balance.load_balancing_loss(
                p, counts, self.top_k, self.aux_loss_coef, group, valid
            )
        elif self.aux_loss == "sequence":
            if routing.seq_len is None:
                raise ValueError(
                    "aux_loss='sequence' needs the sequence length: call the router with "
                    "seq_len=S, or the MoE layer with a batch-first input [B, S, H]"
                )
            bal = balance.sequence_balancing_loss(
                p, routing.expert_ids, routing.seq_len, self.aux_loss_coef, group, valid
            )
        else:
            bal = p.new_zeros(())
        return bal, balance.z_loss(routing.logits, self.z_loss_coef, group, valid)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Aux-loss-free balancing step: sum ``tokens_per_expert`` over ``group`` (the
        data-parallel group; None: this process), ``expert_bias += bias_update_rate ·
        sign(mean load − load)``, reset the counts. Collective over ``group``."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs a router built with expert_bias=True")
        balance.update_expert_bias(self, group)

    def _apply(self, fn, recurse=True):
        """Module.to / .half / .cuda: ``expert_bias`` moves but stays fp32 (a bf16 bias would
        round away updates of 1e-3)."""
        bias = self._buffers.get("expert_bias")
        super()._apply(fn, recurse)
        new = self._buffers.get("expert_bias")
        if bias is not None and new is not None and new.dtype != torch.float32:
            self._buffers["expert_bias"] = bias.to(device=new.device, dtype=torch.float32)
        return self

    def extra_repr(self) -> str:
        extra = [f"score={self.score}"]
        if self.num_groups is not None:
            extra.append(f"groups={self.group_topk}/{self.num_groups}")
        if self.expert_bias is not None:
            extra.append(f"expert_bias(rate={self.bias_update_rate})")
        if self.scaling_factor is not None:
            extra.append(f"scaling_factor={self.scaling_factor}")
        return f"experts={self.num_experts}, top_k={self.top_k}, " + ", ".join(extra)


def _check_valid(valid: torch.Tensor, tokens: int, device) -> torch.Tensor:
    """``valid`` as a [T] bool mask on ``device``, or a ValueError naming what is wrong."""
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool mask (True: a valid target), got {valid.dtype}")
    if valid.dim() != 1 or valid.shape[0] != tokens:
        raise ValueError(
            f"valid must be one flag per routed token, [{tokens}], got {tuple(valid.shape)}"
        )
    return valid.to(device)
