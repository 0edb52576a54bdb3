"""Expert-parallel dropless dispatch / combine: variable-split all-to-alls as custom ops.

    rows, recv_counts, route = ep_dispatch(permuted, counts, group)  # to the experts' ranks
    out = ep_combine(expert_out, route)                             # and back

``permuted [N, H]`` is expert-major over all E experts (``counts [E]`` on the device); the
split sizes are read on the host once (docs/moe.md, "Expert-parallel transport")."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from fastpar.comm.collectives import _all_to_all


class Route(NamedTuple):
    """Where ``ep_dispatch`` sent the rows: ``splits [2, ep]`` int64 on the CPU (rows sent to /
    received from each rank), ``where [R]`` (the local-expert-major row of each received row),
    ``num_rows`` N, the EP ``group``."""

    splits: torch.Tensor
    where: torch.Tensor
    num_rows: int
    group: dist.ProcessGroup


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def _arrival_positions(recv_counts: torch.Tensor, rows: int) -> torch.Tensor:
    """``[R]`` int64: the local-expert-major row of each received row (received rows come
    grouped by (source, local expert), sources in rank order)."""
    ep, e_loc = recv_counts.shape
    by_source = recv_counts.reshape(-1)  # blocks (s, e)
    src_start = torch.cumsum(by_source, 0) - by_source
    by_expert = recv_counts.t().reshape(-1)  # blocks (e, s)
    dst_start = (torch.cumsum(by_expert, 0) - by_expert).view(e_loc, ep).t().reshape(-1)
    blocks = torch.arange(ep * e_loc, dtype=torch.int64, device=recv_counts.device)
    block = torch.repeat_interleave(blocks, by_source, output_size=rows)
    arange = torch.arange(rows, dtype=torch.int64, device=recv_counts.device)
    return arange - src_start.index_select(0, block) + dst_start.index_select(0, block)


def _move_impl(
    x: torch.Tensor,
    where: torch.Tensor,
    splits: torch.Tensor,
    to_experts: bool,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    sent, received = splits.tolist()  # a CPU tensor: no device sync
    if to_experts:
        arrived = _all_to_all(x, received, sent, group)
        return torch.empty_like(arrived).index_copy_(0, where, arrived)
    return _all_to_all(x.index_select(0, where), sent, received, group)


def _dispatch_impl(
    x: torch.Tensor, counts: torch.Tensor, ep: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    send = counts.reshape(ep, -1)
    recv_counts = _all_to_all(send.contiguous(), None, None, group)  # [ep (source), E_local]
    if group.size() == 1:  # _all_to_all returned its input: a custom op must not alias it
        recv_counts = recv_counts.clone()
    # the one host read: rows to send to / receive from each rank
    splits = torch.stack([send.sum(1), recv_counts.sum(1)]).cpu()
    where = _arrival_positions(recv_counts, int(splits[1].sum()))
    rows = _move_impl(x, where, splits, True, group)
    return rows, recv_counts, splits, where


class _Move(torch.autograd.Function):
    """Eager twin of ``fastpar::moe_ep_move`` (no custom-op dispatch cost)."""

    @staticmethod
    def forward(ctx, x, where, splits, to_experts, group):
        ctx.save_for_backward(where, splits)
        ctx.to_experts, ctx.group = to_experts, group
        return _move_impl(x, where, splits, to_experts, group)

    @staticmethod
    def backward(ctx, grad):
        where, splits = ctx.saved_tensors
        dx = _Move.apply(grad, where, splits, not ctx.to_experts, ctx.group)
        return dx, None, None, None, None


class _Dispatch(torch.autograd.Function):
    """Eager twin of ``fastpar::moe_ep_dispatch``."""

    @staticmethod
    def forward(ctx, x, counts, group):
        rows, recv_counts, splits, where = _dispatch_impl(x, counts, group.size(), group)
        ctx.save_for_backward(where, splits)
        ctx.group = group
        ctx.mark_non_differentiable(recv_counts, splits, where)
        return rows, recv_counts, splits, where

    @staticmethod
    def backward(ctx, grad_rows, *_):
        where, splits = ctx.saved_tensors
        return _Move.apply(grad_rows, where, splits, False, ctx.group), None, None


@torch.library.custom_op("fastpar::moe_ep_move", mutates_args=())
def _move(
    x: torch.Tensor,
    where: torch.Tensor,
    splits: torch.Tensor,
    num_out: int,
    to_experts: bool,
    group_name: str,
) -> torch.Tensor:
    out = _move_impl(x, where, splits, to_experts, _group(group_name))
    if out.shape[0] != num_out:
        raise RuntimeError(f"moe_ep_move: {out.shape[0]} rows arrived, {num_out} expected")
    return out.clone() if out is x else out


@_move.register_fake
def _move_fake(x, where, splits, num_out, to_experts, group_name):
    return x.new_empty(num_out, *x.shape[1:])


def _move_setup(ctx, inputs, output):
    x, where, splits, _, to_experts, group_name = inputs
    ctx.save_for_backward(where, splits)
    ctx.num_in, ctx.to_experts, ctx.group_name = x.shape[0], to_experts, group_name


def _move_backward(ctx, grad):
    where, splits = ctx.saved_tensors
    dx = _move(grad, where, splits, ctx.num_in, not ctx.to_experts, ctx.group_name)
    return dx, None, None, None, None, None


_move.register_autograd(_move_backward, setup_context=_move_setup)


@torch.library.custom_op("fastpar::moe_ep_dispatch", mutates_args=())
def _dispatch(
    x: torch.Tensor, counts: torch.Tensor, ep: int, group_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _dispatch_impl(x, counts, ep, _group(group_name))


@_dispatch.register_fake
def _dispatch_fake(x, counts, ep, group_name):
    rows = torch.library.get_ctx().new_dynamic_size()
    recv_counts = counts.new_empty(ep, counts.shape[0] // ep)
    splits = torch.empty(2, ep, dtype=torch.int64, device="cpu")
    where = counts.new_empty(rows)
    return x.new_empty(rows, *x.shape[1:]), recv_counts, splits, where


def _dispatch_setup(ctx, inputs, output):
    x, _, _, group_name = inputs
    _, recv_counts, splits, where = output
    ctx.save_for_backward(where, splits)
    ctx.num_in, ctx.group_name = x.shape[0], group_name
    ctx.mark_non_differentiable(recv_counts, splits, where)


def _dispatch_backward(ctx, grad_rows, *_):
    where, splits = ctx.saved_tensors
    dx = _move(grad_rows, where, splits, ctx.num_in, False, ctx.group_name)
    return dx, None, None, None


_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


def ep_dispatch(
    x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Rows ``x [N, H]`` (expert-major, ``counts [E]``) to the ranks of their experts:
    ``(rows [R, H] local-expert-major, recv_counts [ep, E_local], route)``; ``route`` is what
    ``ep_combine`` needs to send the results back. Differentiable in ``x``. Communicates over
    ``group`` (EP): one all-to-all of the counts, one of the rows."""
    if torch.compiler.is_compiling():
        rows, recv_counts, splits, where = _dispatch(x, counts, group.size(), group.group_name)
    else:
        rows, recv_counts, splits, where = _Dispatch.apply(x, counts, group)
    return rows, recv_counts, Route(splits, where, x.shape[0], group)


def ep_combine(y: torch.Tensor, route: Route) -> torch.Tensor:
    """Inverse of ``ep_dispatch``: local-expert-major ``y [R, H']`` -> ``[N, H']`` in the order
    this rank dispatched. Differentiable in ``y``. Communicates over the EP group."""
    if torch.compiler.is_compiling():
        return _move(y, route.where, route.splits, route.num_rows, False, route.group.group_name)
    return _Move.apply(y, route.where, route.splits, False, route.group)
