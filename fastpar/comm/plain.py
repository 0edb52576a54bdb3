"""Non-differentiable collectives: torch.distributed's, with the same arguments, semantics and
results (in place, ``async_op`` returns the work), so that every collective of fastpar runs
from ``fastpar/comm/`` (``tests/test_imports.py`` enforces it). ``group`` None is the default
group; ranks named by ``src``, ``dst`` and peers are global ranks, as in torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar.flight.record import note_p2p
from fastpar.mesh.ranks import Group

SUM = dist.ReduceOp.SUM
MAX = dist.ReduceOp.MAX


def all_reduce(tensor: torch.Tensor, op=SUM, group: Group = None, async_op: bool = False):
    """In place: ``tensor`` becomes the ``op`` of every rank's ``tensor`` over ``group``."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group: Group = None, async_op=False):
    """``tensor_list[r]`` becomes rank r's ``tensor`` (each rank of ``group``)."""
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False
):
    """``output`` [world · n, ...] becomes every rank's ``input`` [n, ...] in rank order."""
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op=SUM, group: Group = None, async_op=False
):
    """``output`` becomes this rank's chunk of the ``op`` over ``group`` of every ``input``."""
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False):
    """In place: ``tensor`` becomes global rank ``src``'s ``tensor`` on every rank of ``group``."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def barrier(group: Group = None) -> None:
    """Wait until every rank of ``group`` has reached it."""
    dist.barrier(group=group)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group: Group = None,
    async_op: bool = False,
):
    """Rows ``input_split_sizes[j]`` of ``input`` go to rank j, ``output_split_sizes[j]`` rows
    of ``output`` arrive from rank j (None: equal splits)."""
    return dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def start_p2p(ops: list) -> list:
    """Start ``ops``, each ``(dist.isend | dist.irecv, tensor, global peer, tag)`` on the default
    group; their works. CPU tensors (gloo, which does not coalesce): each op directly, what
    ``batch_isend_irecv`` does there, without building a ``P2POp`` per op (~10 us each on 2
    loaded cores); other devices: one ``batch_isend_irecv`` (coalesced on NCCL)."""
    note_p2p(ops)  # the flight recorder's record of them
    if ops[0][1].device.type == "cpu":
        return [op(t, peer, tag=tag) for op, t, peer, tag in ops]
    return dist.batch_isend_irecv([dist.P2POp(op, t, peer, tag=tag) for op, t, peer, tag in ops])


def exchange(send: torch.Tensor, recv: torch.Tensor, to: int, source: int, group, tag: int):
    """Start sending ``send`` to global rank ``to`` and receiving ``recv`` from ``source``
    over ``group`` (one ``batch_isend_irecv``); their works."""
    ops = [
        dist.P2POp(dist.isend, send, to, group, tag),
        dist.P2POp(dist.irecv, recv, source, group, tag),
    ]
    return dist.batch_isend_irecv(ops)


def all_gather_object(object_list: list, obj, group: Group = None) -> None:
    """``object_list[r]`` becomes rank r's picklable ``obj``."""
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int, group: Group = None) -> None:
    """In place: ``object_list`` becomes global rank ``src``'s on every rank of ``group``."""
    dist.broadcast_object_list(object_list, src=src, group=group)


def gather_object(obj, object_gather_list: list | None, dst: int, group: Group = None) -> None:
    """On ``dst``, ``object_gather_list[r]`` becomes rank r's ``obj`` (None elsewhere)."""
    dist.gather_object(obj, object_gather_list, dst=dst, group=group)
