"""MoE permute / unpermute: autograd Functions and the functional API. ``moe_permute`` groups the
rows of ``x [T, H]`` by expert, ``moe_unpermute`` combines them back weighted by the routing
probabilities; local to one rank, deterministic, no host sync (docs/kernels.md, "MoE permute")."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from fastpar.ops import backend
from fastpar.reference import moe_permute as ref

PERMUTE_OP = "moe_permute"
UNPERMUTE_OP = "moe_unpermute"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MODES = ("capacity", "dropless")

backend.register_op(
    PERMUTE_OP,
    ("triton", "reference"),
    "group token rows by expert ([E, C, H] with capacity, [T·k, H] dropless); stable slots",
)
backend.register_op(
    UNPERMUTE_OP,
    ("triton", "reference"),
    "probability-weighted combine of expert rows back to [T, H]; fp32 accumulation, no atomics",
)


@dataclass(frozen=True)
class PermuteInfo:
    """Where every (token, choice) went; returned by ``moe_permute``, consumed by
    ``moe_unpermute``. Tensors are on the device of the routing."""

    slots: torch.Tensor
    """``[T, k]`` int64: row of each (token, choice) in the flattened permuted buffer
    (``e·C + position`` in capacity mode, the row index dropless); −1 when dropped."""
    counts: torch.Tensor
    """``[E]`` int64: (token, choice) pairs routed to each expert, before dropping."""
    kept_counts: torch.Tensor
    """``[E]`` int64: pairs each expert keeps, ``min(counts, C)`` (= ``counts`` dropless)."""
    offsets: torch.Tensor
    """``[E+1]`` int64: first row of each expert in the flattened buffer, then its row count:
    the exclusive prefix sum of ``counts`` dropless; ``e·C`` in capacity mode."""
    num_dropped: torch.Tensor
    """0-dim int64: pairs dropped for lack of capacity (always 0 dropless)."""
    num_tokens: int
    """``T``."""
    top_k: int
    """``k``, choices per token."""
    num_experts: int
    """``E``."""
    capacity: int | None
    """``C`` rows per expert, or None dropless."""
    hidden: int
    """``H``, the hidden size of the permuted rows."""
    mode: str
    """"capacity" or "dropless"."""

    @property
    def num_rows(self) -> int:
        """Rows of the flattened permuted buffer: ``E·C`` (capacity) or ``T·k`` (dropless)."""
        if self.capacity is None:
            return self.num_tokens * self.top_k
        return self.num_experts * self.capacity

    @property
    def permuted_shape(self) -> tuple[int, ...]:
        """``(E, C, H)`` in capacity mode, ``(T·k, H)`` dropless."""
        if self.capacity is None:
            return (self.num_rows, self.hidden)
        return (self.num_experts, self.capacity, self.hidden)


def _impl(op: str, t: torch.Tensor) -> Any:
    """The module that moves the rows of ``t``: the Triton launchers or the reference (always
    the reference for float64, which the kernels would accumulate in fp32)."""
    if t.dtype != torch.float64 and backend.select(op, t.device.type) == "triton":
        return importlib.import_module("fastpar.kernels.moe_permute")
    return ref


class MoEPermuteFunction(torch.autograd.Function):
    """``x [T, H]`` → permuted rows ``[R, H]``; backward sums each token's kept grad rows."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        slots: torch.Tensor,
        kept_counts: torch.Tensor,
        capacity: int | None,
        num_rows: int,
    ) -> torch.Tensor:
        out = _impl(PERMUTE_OP, x).permute(x, slots, kept_counts, capacity, num_rows)
        ctx.save_for_backward(slots)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (slots,) = ctx.saved_tensors
        dx = _impl(PERMUTE_OP, grad_out).unpermute(grad_out, slots, None)
        return dx, None, None, None, None


class MoEUnpermuteFunction(torch.autograd.Function):
    """Expert rows ``[R, H]`` and ``probs [T, k]`` → ``[T, H]``; backward writes each slot's
    gradient row once (no atomics) and the probs gradient as per-slot dot products."""

    @staticmethod
    def forward(
        ctx: Any,
        src: torch.Tensor,
        probs: torch.Tensor,
        slots: torch.Tensor,
        kept_counts: torch.Tensor,
        capacity: int | None,
    ) -> torch.Tensor:
        out = _impl(UNPERMUTE_OP, src).unpermute(src, slots, probs)
        ctx.save_for_backward(src, probs, slots, kept_counts)
        ctx.capacity = capacity
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        src, probs, slots, kept_counts = ctx.saved_tensors
        need_src, need_probs = ctx.needs_input_grad[:2]
        d_src, d_probs = _impl(UNPERMUTE_OP, grad).unpermute_backward(
            grad, src, slots, probs, kept_counts, ctx.capacity, need_src, need_probs
        )
        return d_src, d_probs, None, None, None


def _is_int(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _check_permute(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    order: torch.Tensor | None,
) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"x must be [T, H] float32/bfloat16/float16 (float64 runs the reference), got "
            f"{tuple(x.shape)} {x.dtype}; "
            "flatten batch and sequence first: x.reshape(-1, hidden)"
        )
    t = x.shape[0]
    if expert_ids.dim() != 2 or expert_ids.shape[0] != t or expert_ids.shape[1] < 1:
        raise ValueError(
            f"expert_ids must be [T, k] with T = {t} (x's rows) and k >= 1, got "
            f"{tuple(expert_ids.shape)}; for top-1 routing pass ids[:, None]"
        )
    if not _is_int(expert_ids):
        raise ValueError(
            f"expert_ids must hold integer expert indices (int64), got {expert_ids.dtype}; "
            "pass ids.long()"
        )
    if expert_ids.device != x.device:
        raise ValueError(f"expert_ids on {expert_ids.device} but x on {x.device}: move one")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if capacity is not None and capacity < 0:
        raise ValueError(
            f"capacity must be >= 0 rows per expert or None (dropless), got {capacity}"
        )
    if order is not None and (
        order.shape != (expert_ids.numel(),) or not _is_int(order) or order.device != x.device
    ):
        raise ValueError(
            f"order must be an integer [T·k] = [{expert_ids.numel()}] permutation of the "
            f"choice-major pair indices j·T + t on {x.device}, got {tuple(order.shape)} "
            f"{order.dtype} on {order.device}"
        )


def moe_permute(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PermuteInfo]:
    """Group the rows of ``x`` by expert.

    ``x [T, H]`` (fp32 / bf16 / fp16), ``expert_ids [T, k]`` int64 in ``[0, E)``,
    ``num_experts`` ``E``; ``capacity`` ``C`` rows per expert, or None for dropless.
    ``order`` (optional ``[T·k]`` int64): a permutation of the choice-major pair indices
    ``j·T + t`` giving the order in which pairs claim positions (e.g. sorted by descending
    routing probability for a "probs" drop policy); default: choice-major order, all first
    choices before any second choice (GShard's "position" policy).

    Capacity mode returns ``[E, C, H]``: expert ``e``'s kept pairs at rows ``0 .. kept − 1`` in
    processing order, zero rows after; pairs at position ``>= C`` are dropped. Dropless returns
    ``[T·k, H]`` expert-major (expert ``e`` at rows ``info.offsets[e] : info.offsets[e+1]``).
    Output dtype = ``x``'s; differentiable in ``x``. No host synchronisation in either mode.
    """
    _check_permute(x, expert_ids, num_experts, capacity, order)
    ids = expert_ids.long()
    torch._assert_async(
        ((ids >= 0) & (ids < num_experts)).all(),
        f"moe_permute: an expert id is outside [0, {num_experts}); ids must index the experts",
    )
    t, k = ids.shape
    if order is not None:
        order = order.long()
        inside = ((order >= 0) & (order < t * k)).all()
        torch._assert_async(inside, "moe_permute: order holds an index outside [0, T·k)")
        hits = torch.zeros(t * k, dtype=torch.int64, device=order.device)
        hits.index_add_(0, order.clamp(0, max(t * k - 1, 0)), torch.ones_like(order))
        torch._assert_async(
            (hits == 1).all(), "moe_permute: order is not a permutation of the T·k pair indices"
        )
    slots, counts, kept, offsets, dropped = ref.compute_slots(ids, num_experts, capacity, order)
    info = PermuteInfo(
        slots=slots,
        counts=counts,
        kept_counts=kept,
        offsets=offsets,
        num_dropped=dropped,
        num_tokens=t,
        top_k=k,
        num_experts=num_experts,
        capacity=capacity,
        hidden=x.shape[1],
        mode="dropless" if capacity is None else "capacity",
    )
    out = MoEPermuteFunction.apply(x, slots, kept, capacity, info.num_rows)
    return out.view(info.permuted_shape), info


def moe_unpermute(expert_out: torch.Tensor, probs: torch.Tensor, info: PermuteInfo) -> torch.Tensor:
    """Combine expert rows back into tokens: ``out[t] = Σ_j probs[t, j] · expert_out[slot(t, j)]``.

    ``expert_out``: ``[E, C, H]`` or ``[T·k, H]``, the layout ``moe_permute`` returned (its
    hidden size may differ from the input's); ``probs [T, k]`` any float dtype (dropped choices
    contribute nothing, whatever their weight). Returns ``[T, H]`` in ``expert_out``'s dtype,
    accumulated in fp32, deterministic (no atomics). Differentiable in ``expert_out`` and
    ``probs``.
    """
    t, k = info.num_tokens, info.top_k
    want = info.permuted_shape[:-1]
    if expert_out.dim() != len(want) + 1 or tuple(expert_out.shape[:-1]) != want:
        raise ValueError(
            f"expert_out {tuple(expert_out.shape)} does not match the {info.mode} layout of "
            f"moe_permute: expected {(*want, 'H')}"
        )
    if expert_out.dtype not in FLOAT_DTYPES:
        raise ValueError(f"expert_out must be float32/bfloat16/float16, got {expert_out.dtype}")
    if tuple(probs.shape) != (t, k) or not probs.dtype.is_floating_point:
        raise ValueError(
            f"probs must be float [T, k] = [{t}, {k}], got {tuple(probs.shape)} {probs.dtype}"
        )
    src = expert_out.reshape(info.num_rows, expert_out.shape[-1])
    return MoEUnpermuteFunction.apply(src, probs, info.slots, info.kept_counts, info.capacity)
