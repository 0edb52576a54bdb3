"""Differentiable collectives for tensor and sequence parallelism: named autograd Functions over an
explicit process group (None = the default group), each the identity on a group of one. What
each does forward and backward: docs/layouts.md ("The collectives")."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastpar.flight.record import note, note_splits
from fastpar.mesh.ranks import Group, group_rank, group_size
from fastpar.profiling import nvtx

# torch 2.13 renamed these collectives; the old names are the ones every torch >= 2.4 has
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    category=FutureWarning,
)


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> int:
    dim = dim % x.dim()
    if x.shape[dim] % world:
        raise ValueError(
            f"{what}: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) is not divisible "
            f"by the group size {world}; pad that dimension to a multiple of {world}"
        )
    return dim


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    note(group, "all_reduce", x)  # the flight recorder's record of it
    with nvtx("all_reduce"):
        dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world, "split")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * src.shape[0], *src.shape[1:]), dtype=x.dtype, device=x.device)
    note(group, "all_gather", src)  # the flight recorder's record of it
    with nvtx("all_gather"):
        dist.all_gather_into_tensor(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world, "reduce-scatter")
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((src.shape[0] // world, *src.shape[1:]), dtype=x.dtype, device=x.device)
    note(group, "reduce_scatter", src)  # the flight recorder's record of it
    with nvtx("reduce_scatter"):
        dist.reduce_scatter_tensor(out, src, group=group)
    return out.movedim(0, dim).contiguous()


class CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (entering a TP region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward; identity backward (leaving a TP region with partial sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _conjugate(
    name: str,
    doc: str,
    forward_op: Callable[[torch.Tensor, int, Group], torch.Tensor],
    backward_op: Callable[[torch.Tensor, int, Group], torch.Tensor],
) -> type[torch.autograd.Function]:
    """The autograd Function ``name``: ``forward_op(x, dim, group)`` forward, ``backward_op`` of
    the gradient along the same ``dim`` over the same group backward (its conjugate)."""

    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return forward_op(x, dim, group)

    def backward(ctx, grad: torch.Tensor):
        return backward_op(grad, ctx.dim, ctx.group), None, None

    body = {
        "__doc__": doc,
        "__module__": __name__,
        "__qualname__": name,
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    }
    return types.new_class(name, (torch.autograd.Function,), exec_body=lambda ns: ns.update(body))


ScatterToRegion = _conjugate(
    "ScatterToRegion",
    "Keep this rank's chunk along ``dim`` forward; all-gather the gradient backward.",
    _split,
    _all_gather,
)
GatherFromRegion = _conjugate(
    "GatherFromRegion",
    "All-gather along ``dim`` forward; keep this rank's chunk of the gradient backward.",
    _all_gather,
    _split,
)
AllGatherReduceScatter = _conjugate(
    "AllGatherReduceScatter",
    """All-gather along ``dim`` forward; reduce-scatter the gradient backward.

    Sequence parallelism's entry into a column-parallel layer: every rank's full-sequence
    gradient is a partial sum, which the reduce-scatter completes and re-shards.
    """,
    _all_gather,
    _reduce_scatter,
)
ReduceScatterAllGather = _conjugate(
    "ReduceScatterAllGather",
    """Reduce-scatter along ``dim`` forward; all-gather the gradient backward.

    Sequence parallelism's exit from a row-parallel layer (replaces its all-reduce).
    """,
    _reduce_scatter,
    _all_gather,
)


def copy_to_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    return CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    return ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group = None, dim: int = -1) -> torch.Tensor:
    return ScatterToRegion.apply(x, dim, group)


def gather_from_region(x: torch.Tensor, group: Group = None, dim: int = -1) -> torch.Tensor:
    return GatherFromRegion.apply(x, dim, group)


def scatter_to_sequence(x: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    return ScatterToRegion.apply(x, dim, group)


def gather_from_sequence(x: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    return GatherFromRegion.apply(x, dim, group)


def all_gather_reduce_scatter(x: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    return AllGatherReduceScatter.apply(x, dim, group)


def reduce_scatter_all_gather(x: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    return ReduceScatterAllGather.apply(x, dim, group)


def all_reduce_grad(param: torch.Tensor, group: Group = None):
    """Make ``param``'s gradient the sum over ``group`` of every rank's contribution: a hook on
    the leaf that all-reduces each backward's incoming gradient before it is accumulated into
    ``.grad`` (so gradient accumulation, DDP / ZeRO hooks and clipping see the full gradient).

    For a parameter replicated over ``group`` whose every use sees only this rank's share of a
    split dimension (a per-head norm after a column-split projection). Returns the hook handle.
    """
    if not param.requires_grad:
        raise ValueError("all_reduce_grad needs a parameter that requires grad")

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, group)

    return param.register_hook(hook)


def _all_to_all(
    x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: Group
) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    note_splits(group, x, out_splits, in_splits)  # the flight recorder's record of the splits
    with nvtx("all_to_all"):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 (rows ``in_splits[j]`` go to rank j; ``out_splits[j]``
    arrive from rank j; None = equal splits); backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits, in_splits, group: Group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor,
    group: Group = None,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (see ``AllToAll``)."""
    return AllToAll.apply(x, out_splits, in_splits, group)
