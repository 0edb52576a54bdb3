"""Load balancing for ``TopKRouter``: group-limited top-k (``group_limited_topk``), the
auxiliary losses (``load_balancing_loss``, ``sequence_balancing_loss``, ``z_loss``) and
aux-loss-free balancing (``update_expert_bias``), as docs/moe.md ("Routing") defines them.

``group`` (the losses) / ``token_group`` (a router's): the TP group a sequence-parallel layer's
tokens are split over (``fastpar.moe.tp``); the statistics are then summed over it
(``reduce_from_region``), so the loss is the whole sequence's on every rank. None: the tokens
are all here. ``valid`` (optional ``[T]`` bool): the tokens that count, those whose target is
valid; every denominator is then their count, summed over ``group`` and clamped to >= 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fastpar.comm import group_size, plain, reduce_from_region
from fastpar.moe import config as scores


def _world(group) -> int:
    return 1 if group is None else group_size(group)


def group_limited_topk(
    sel: torch.Tensor, top_k: int, num_groups: int, group_topk: int, group_score_topk: int
) -> torch.Tensor:
    """Expert ids ``[T, k]`` (best first) chosen by ``sel [T, E]`` inside each token's
    ``group_topk`` best groups of ``E / num_groups`` consecutive experts."""
    t, e = sel.shape
    grouped = sel.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(group_score_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    groups = group_scores.topk(group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)
    return sel.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices


def balance_scores(router_probs: torch.Tensor, score: str) -> torch.Tensor:
    """The per-token distribution the balancing losses average: the softmax itself, or the
    sigmoid scores normalised to sum 1 over the experts (DeepSeek-V3, Megatron): the ``balance``
    of ``fastpar.moe.config.SCORES[score]`` (ValueError for a name it lacks)."""
    return scores.score(score).balance(router_probs)


def load_balancing_loss(
    p: torch.Tensor, counts: torch.Tensor, top_k: int, coef: float, group=None, valid=None
) -> torch.Tensor:
    """``coef · E · Σ_i f_i · P_i`` over all T tokens: ``p [T, E]``, ``counts [E]`` routing
    choices per expert (before capacity), f_i = counts_i / (T·k), P_i the mean of ``p``
    (over the tokens of every rank of ``group``, module docstring). ``valid [T]`` bool: over
    the valid tokens only — ``counts`` must then be the valid tokens' choices
    (``valid_counts``), T their number (module docstring)."""
    t, e = p.shape
    if valid is not None:
        n = valid.sum().to(p.dtype).reshape(1)
        psum = torch.where(valid.unsqueeze(1), p, 0.0).sum(dim=0)
        stats = torch.cat([counts.to(p.dtype), psum, n])
        if _world(group) > 1:
            stats = reduce_from_region(stats, group)
        c, psum, n = stats[:e], stats[e : 2 * e], stats[2 * e].clamp(min=1)
        return coef * e * ((c / (n * top_k)) * (psum / n)).sum()
    if _world(group) == 1:
        f = counts.to(torch.float32) / max(1, t * top_k)
        return coef * e * (f * p.mean(dim=0)).sum()
    total = t * _world(group)
    f = reduce_from_region(counts.to(torch.float32), group) / max(1, total * top_k)
    return coef * e * (f * (reduce_from_region(p.sum(dim=0), group) / total)).sum()


def valid_counts(expert_ids: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] fp32: the routing choices per expert of the valid tokens (``expert_ids [T, k]``,
    ``valid [T]`` bool)."""
    k = expert_ids.shape[1]
    w = valid.to(torch.float32).repeat_interleave(k)  # token-major, like ids.reshape(-1)
    out = torch.zeros(num_experts, dtype=torch.float32, device=expert_ids.device)
    return out.index_add_(0, expert_ids.reshape(-1), w)


def sequence_balancing_loss(
    p: torch.Tensor, expert_ids: torch.Tensor, seq_len: int, coef: float, group=None, valid=None
) -> torch.Tensor:
    """The load-balancing loss of each sequence, averaged over the ``T / seq_len`` sequences:
    tokens are rows ``b·S .. (b+1)·S − 1`` of sequence b (batch-first ``[B, S]`` flattened;
    with ``group``, this rank's chunk of every sequence: each sequence is ``seq_len`` × the
    group's size long). ``valid [T]`` bool: each sequence's f_i and P_i over its valid tokens,
    averaged over the sequences with at least one (module docstring)."""
    t, e = p.shape
    k = expert_ids.shape[1]
    if seq_len < 1 or t % seq_len:
        raise ValueError(
            f"aux_loss='sequence' needs whole sequences: {t} tokens are not a multiple of the "
            f"sequence length {seq_len}; pass the batch as [B, S, H] (batch-first)"
        )
    b = t // seq_len
    ids = expert_ids.reshape(b, seq_len * k)
    if valid is not None:
        return _masked_sequence_loss(p, ids, valid.reshape(b, seq_len), k, coef, group)
    counts = torch.zeros(b, e, dtype=torch.float32, device=p.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    if _world(group) == 1:
        f = counts / (seq_len * k)
        pbar = p.reshape(b, seq_len, e).mean(dim=1)
        return coef * e * (f * pbar).sum(dim=-1).mean()
    length = seq_len * _world(group)
    f = reduce_from_region(counts, group) / (length * k)
    pbar = reduce_from_region(p.reshape(b, seq_len, e).sum(dim=1), group) / length
    return coef * e * (f * pbar).sum(dim=-1).mean()


def _masked_sequence_loss(p, ids, valid, k: int, coef: float, group) -> torch.Tensor:
    """``sequence_balancing_loss`` over the valid tokens: ``ids [B, S·k]``, ``valid [B, S]``."""
    b, s = valid.shape
    e = p.shape[1]
    w = valid.to(p.dtype)
    counts = torch.zeros(b, e, dtype=p.dtype, device=p.device)
    counts.scatter_add_(1, ids, w.repeat_interleave(k, dim=1))
    psum = torch.where(valid.unsqueeze(-1), p.reshape(b, s, e), 0.0).sum(dim=1)
    stats = torch.cat([counts, psum, w.sum(dim=1, keepdim=True)], dim=1)  # [B, 2E + 1]
    if _world(group) > 1:
        stats = reduce_from_region(stats, group)
    c, psum, n = stats[:, :e], stats[:, e : 2 * e], stats[:, 2 * e :]
    per_seq = ((c / (n.clamp(min=1) * k)) * (psum / n.clamp(min=1))).sum(dim=-1)  # 0 if empty
    seqs = (n > 0).to(p.dtype).sum().clamp(min=1)
    return coef * e * per_seq.sum() / seqs


def z_loss(logits: torch.Tensor, coef: float, group=None, valid=None) -> torch.Tensor:
    """``coef · mean_t(logsumexp(logits_t)²)`` (over every rank of ``group``'s tokens; the
    valid ones only with ``valid [T]`` bool)."""
    sq = torch.logsumexp(logits, dim=-1).square()
    if valid is not None:
        stats = torch.stack([torch.where(valid, sq, 0.0).sum(), valid.sum().to(sq.dtype)])
        if _world(group) > 1:
            stats = reduce_from_region(stats, group)
        return coef * stats[0] / stats[1].clamp(min=1)
    if _world(group) == 1:
        return coef * sq.mean()
    return coef * reduce_from_region(sq.sum(), group) / (sq.shape[0] * _world(group))


@torch.no_grad()
def _sum_over_token_groups(routers: list, load: torch.Tensor) -> None:
    """Sequence-parallel routers saw only their TP rank's tokens: sum their counts (rows of
    ``load``, in place) over each router's ``token_group`` too, one all-reduce per group."""
    spans, lo = [], 0
    for r in routers:
        spans.append((getattr(r, "token_group", None), lo, lo + r.num_experts))
        lo += r.num_experts
    for g in {id(g): g for g, _, _ in spans if _world(g) > 1}.values():
        rows = torch.cat([torch.arange(a, b) for h, a, b in spans if h is g]).to(load.device)
        part = load.index_select(0, rows)
        plain.all_reduce(part, group=g)
        load.index_copy_(0, rows, part)


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Update the expert bias of every router of ``model`` that has one, from the tokens its
    training forwards routed since the last update, then reset those counts. ``group``: the
    ranks that hold replicas of these routers and route different tokens (the data-parallel
    group, ``mesh.dp_group``; None: this process alone); the counts are summed over it with one
    all-reduce, so every replica computes the same bias. Call it once per optimizer step on
    every rank of ``group`` (collective). Returns the number of routers updated."""
    routers = [
        m
        for m in model.modules()
        if getattr(m, "expert_bias", None) is not None and hasattr(m, "tokens_per_expert")
    ]
    if not routers:
        return 0
    load = torch.cat([r.tokens_per_expert for r in routers])
    if group is not None and dist.get_world_size(group) > 1:
        plain.all_reduce(load, group=group)
    _sum_over_token_groups(routers, load)
    for r, n in zip(routers, load.split([r.num_experts for r in routers]), strict=True):
        n = n.to(torch.float32)  # bias += rate · sign(mean(load) − load)
        r.expert_bias.add_(torch.sign(n.mean() - n), alpha=r.bias_update_rate)
        r.tokens_per_expert.zero_()
    return len(routers)
