"""Pure-torch MoE permute / unpermute: the CPU path and the oracle of the Triton kernels.
``compute_slots`` (used by every backend) assigns ``slots [T, k]``; ``permute``, ``unpermute``
and ``unpermute_backward`` move the rows with index ops only: no host sync, differentiable
(docs/kernels.md, "MoE permute / unpermute")."""

from __future__ import annotations

import torch


def compute_slots(
    expert_ids: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots of a routing, by a stable sort of the expert ids: O(T·k) memory, no host sync.

    ``expert_ids [T, k]`` int64 in ``[0, E)``. Pairs are processed choice-major (every token's
    choice 0 in token order, then every token's choice 1, ...): pair ``p = j·T + t``. ``order``
    ``[T·k]`` int64, when given, is a permutation of those pair indices: ``order[i]`` is the pair
    processed ``i``-th (a router's priority order, e.g. by descending probability). A pair's
    position is the number of pairs routed to the same expert that are processed before it.

    Capacity mode (``capacity`` an int ``C``): slot ``e·C + position`` when ``position < C``,
    else −1 (dropped). Dropless (``capacity=None``): the slot is the pair's index among all pairs
    sorted by (expert, processing order), i.e. row ``offsets[e] + position``.

    Returns ``(slots [T, k], counts [E], kept_counts [E], offsets [E+1], num_dropped [])``, all
    int64 on ``expert_ids.device``; ``counts`` are the pairs routed to each expert before
    dropping. ``offsets`` are the first row of each expert: ``e·C`` in capacity mode, the
    exclusive prefix sum of ``counts`` dropless.
    """
    t, k = expert_ids.shape
    n = t * k
    dev = expert_ids.device
    e = expert_ids.t().reshape(-1).long()  # choice-major pairs
    e_ord = e if order is None else e.index_select(0, order)
    sorted_e, perm = torch.sort(e_ord, stable=True)
    pair_of_sorted = perm if order is None else order.index_select(0, perm)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, e, torch.ones_like(e))  # not bincount: it syncs on CUDA
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    rank = torch.arange(n, dtype=torch.int64, device=dev)
    if capacity is None:
        slot_sorted = rank
        kept = counts.clone()
        offsets = torch.cat([ends.new_zeros(1), ends])
    else:
        pos = rank - starts.index_select(0, sorted_e)
        slot_sorted = torch.where(pos < capacity, sorted_e * capacity + pos, -1)
        kept = counts.clamp(max=capacity)
        offsets = torch.arange(num_experts + 1, dtype=torch.int64, device=dev) * capacity
    slots = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, pair_of_sorted, slot_sorted)
    num_dropped = (counts - kept).sum()
    slots = slots.view(k, t).t().contiguous() if k > 1 else slots.view(t, k)  # plain strides
    return slots, counts, kept, offsets, num_dropped


def _scratch_index(slots: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``slots`` flattened ``[T·k]``, with dropped choices (−1) sent to the scratch row ``R``."""
    flat = slots.reshape(-1)
    return torch.where(flat >= 0, flat, num_rows)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _row_pairs(slots: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of ``slots``: the token-major pair ``t·k + j`` stored in each row, ``[R]`` int64;
    ``T·k`` (one past the last pair) for unused rows."""
    n = slots.numel()
    pairs = torch.arange(n, dtype=torch.int64, device=slots.device)
    pair = torch.full((num_rows + 1,), n, dtype=torch.int64, device=slots.device)
    return pair.scatter_(0, _scratch_index(slots, num_rows), pairs)[:num_rows]


def _pad_row(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one zero appended along dim 0 (the source of every unused row)."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


def permute(
    x: torch.Tensor,
    slots: torch.Tensor,
    kept_counts: torch.Tensor,
    capacity: int | None,
    num_rows: int,
) -> torch.Tensor:
    """Rows of ``x [T, H]`` copied to their slots: ``[R, H]`` in ``x``'s dtype, zero where unused.

    ``slots [T, k]``; ``kept_counts`` is part of the launcher contract (the Triton kernel
    zeroes unused rows with it); dropless (``capacity=None``) every row is used.
    A gather: each row reads the token it holds, unused rows read an appended zero row.
    """
    del kept_counts
    k = slots.shape[1]
    token = torch.div(_row_pairs(slots, num_rows), k, rounding_mode="floor")
    return (x if capacity is None else _pad_row(x)).index_select(0, token)


def _gathered(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``src [R, H]`` rows at ``slots [T, k]`` as ``[T, k, H]`` (zeros for dropped choices)."""
    num_rows, h = src.shape
    padded = torch.cat([src, src.new_zeros(1, h)])
    return padded.index_select(0, _scratch_index(slots, num_rows)).view(*slots.shape, h)


def unpermute(src: torch.Tensor, slots: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = Σ_j probs[t, j] · src[slots[t, j]]`` over kept choices: ``[T, H]``, src's dtype.

    ``src [R, H]``; ``probs [T, k]`` (any float dtype) or None for weight 1 (the backward of
    ``permute``). Accumulated in fp32 (fp64 for fp64 inputs): each row, weighted, is added to
    the token it holds (``index_add``); unused rows go to a discarded scratch token ``T``.
    """
    acc = _acc_dtype(src.dtype)
    t, k = slots.shape
    pair = _row_pairs(slots, src.shape[0])
    rows = src.to(acc)
    if probs is not None:
        w = _pad_row(probs.reshape(-1).to(acc)).index_select(0, pair)
        rows = rows * w.unsqueeze(1)
    out = rows.new_zeros(t + 1, src.shape[1])
    out = out.index_add_(0, torch.div(pair, k, rounding_mode="floor"), rows)
    return out[:t].to(src.dtype)


def unpermute_backward(
    grad: torch.Tensor,
    src: torch.Tensor,
    slots: torch.Tensor,
    probs: torch.Tensor,
    kept_counts: torch.Tensor,
    capacity: int | None,
    need_src: bool = True,
    need_probs: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``unpermute`` for ``grad [T, H]``: (d src ``[R, H]``, d probs ``[T, k]``).

    ``d src[slots[t, j]] = probs[t, j] · grad[t]`` (0 on unused rows), in src's dtype;
    ``d probs[t, j] = ⟨grad[t], src[slots[t, j]]⟩`` (0 when dropped), in probs' dtype. Either is
    None when not ``need_*``. ``kept_counts`` and ``capacity`` are unused here.
    """
    del kept_counts, capacity
    acc = _acc_dtype(src.dtype)
    k = slots.shape[1]
    num_rows = src.shape[0]
    kept = slots >= 0
    g = grad.to(acc)
    d_src = d_probs = None
    if need_src:
        pair = _row_pairs(slots, num_rows)
        rows = _pad_row(g).index_select(0, torch.div(pair, k, rounding_mode="floor"))
        w = _pad_row(probs.reshape(-1).to(acc)).index_select(0, pair)
        d_src = rows.mul_(w.unsqueeze(1)).to(src.dtype)
    if need_probs:
        dots = (_gathered(src, slots).to(acc) * g.unsqueeze(1)).sum(dim=-1)
        d_probs = torch.where(kept, dots, 0.0).to(probs.dtype)
    return d_src, d_probs
