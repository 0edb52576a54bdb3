"""Vocab-parallel fused linear cross-entropy: the loss of ``hidden @ weight_shard.T`` in row chunks,
without the ``[N, V_local]`` logits; one all-gather per chunk in forward, one all-reduce of
d hidden in backward. The algorithm and its two backward modes: docs/kernels.md ("Fused linear
cross-entropy")."""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from fastpar import debug
from fastpar.comm import plain
from fastpar.comm.checks import check_same
from fastpar.comm.collectives import copy_to_region
from fastpar.ops import backend
from fastpar.ops.cross_entropy import LOW_AND_FP32 as FLOAT_DTYPES
from fastpar.ops.cross_entropy import (
    _check_fit,
    _check_ids,
    _check_options,
    _check_target_dtype,
    _gather_stats,
    _group_info,
    _header,
    _loss_fields,
    _row_grad,
)
from fastpar.reference import linear_cross_entropy as ref

OP = "vocab_parallel_linear_cross_entropy"

backend.register_op(
    OP,
    ("triton", "reference"),
    "linear + vocab-parallel cross-entropy in row chunks (one [chunk, 4] all-gather each); "
    "never holds the [N, V_local] logits",
)


def _triton_grad(x, target, local, row_max, log_s, row_grad, **spec) -> torch.Tensor:
    kernels = importlib.import_module("fastpar.kernels.linear_cross_entropy")
    return kernels.grad_logits_(x, target, row_max, log_s, row_grad, **spec)


def _impl(device_type: str, backward: bool = False) -> tuple[Any, Any]:
    """(stats, in-place gradient) functions for ``chunk_loop``: the Triton launchers (the
    statistics kernel leaves the logits as they are, so the recompute backward skips it) or
    the torch reference (``stats_`` / ``grad_``)."""
    if backend.select(OP, device_type) == "triton":
        kernels = importlib.import_module("fastpar.kernels.linear_cross_entropy")
        return (None if backward else kernels.local_stats), _triton_grad
    return ref.stats_, ref.grad_


def _gatherer(target, group, tp: int, n_local: int, vocab_size: int, ignore_index: int):
    """``gather(stats, first)`` for ``chunk_loop``: all-gathers a chunk's ``[C, 4]`` stats over
    ``group``; the first chunk carries the header (every target's digest) and the checks."""

    def gather(stats: torch.Tensor, first: bool) -> torch.Tensor:
        if tp == 1:
            out = stats.unsqueeze(0)
        elif first:
            header = _header(n_local, vocab_size, ignore_index, target)
            out = _gather_stats(stats, header, tp, group)  # raises on every rank on mismatch
        else:
            send = stats.contiguous()
            out = torch.empty((tp * stats.shape[0], 4), dtype=stats.dtype, device=stats.device)
            plain.all_gather_into_tensor(out, send, group=group)
            out = out.view(tp, stats.shape[0], 4)
        if first:  # after the gather: every rank sees the same values and raises alike
            _check_fit(n_local, tp, vocab_size)
            _check_ids(target, vocab_size, ignore_index)
        return out

    return gather


class VocabParallelLinearCrossEntropyFunction(torch.autograd.Function):
    """Loss of ``hidden [N, H] @ weight [V_local, H].T`` against global ids ``target [N]``.

    Returns fp32 ``[N]`` for ``reduction="none"``, else a scalar. The gradient of ``hidden`` is
    this shard's partial sum (the functional all-reduces it); see docs/kernels.md.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup | None,
        options: tuple,
    ) -> torch.Tensor:
        tp, rank, vocab_size, ignore_index, alpha, z_loss, reduction, chunk, recompute, grads = (
            options
        )
        n_local = weight.shape[0]
        vocab_start = rank * n_local
        n_valid = max(0, min(n_local, vocab_size - vocab_start))
        stats_fn, grad_fn = _impl(hidden.device.type)
        valid = target != ignore_index
        count = valid.sum().clamp(min=1).float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        eager = grads and (need_h or need_w) and not recompute
        row_grad = None
        if eager:
            g = 1.0 / count if reduction == "mean" else torch.ones((), device=hidden.device)
            row_grad = _row_grad(valid, g)
        spec = dict(
            vocab_start=vocab_start,
            n_valid=n_valid,
            vocab_size=vocab_size,
            ignore_index=ignore_index,
            label_smoothing=alpha,
            z_loss=z_loss,
            chunk_size=chunk,
        )
        out = ref.chunk_loop(
            hidden,
            weight,
            target,
            row_grad=row_grad,
            hidden_grad=need_h,
            weight_grad=need_w,
            gather=_gatherer(target, group, tp, n_local, vocab_size, ignore_index),
            local_stats=stats_fn,
            grad_fn=grad_fn,
            **spec,
        )
        ctx.eager, ctx.reduction, ctx.spec, ctx.weight_dtype = eager, reduction, spec, weight.dtype
        ctx.used = False
        if eager:
            ctx.save_for_backward(out.grad_hidden, out.grad_weight)
        else:
            ctx.save_for_backward(hidden, weight, target, out.row_max, out.log_s, count)
        loss = out.loss
        if reduction == "none":
            return loss
        total = loss.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g = grad_out.float()
        if ctx.eager:
            if ctx.used:
                raise RuntimeError(
                    "vocab_parallel_linear_cross_entropy: backward ran twice through a graph "
                    "whose gradients were computed in forward and are scaled in place; pass "
                    "recompute=True to backward more than once (retain_graph=True)"
                )
            ctx.used = True
            grad_hidden, grad_weight = ctx.saved_tensors
            if grad_hidden is not None:
                grad_hidden = grad_hidden.mul_(g)
            if grad_weight is not None:
                grad_weight = grad_weight.mul_(g).to(ctx.weight_dtype)
            return grad_hidden, grad_weight, None, None, None
        hidden, weight, target, row_max, log_s, count = ctx.saved_tensors
        if ctx.reduction == "mean":
            g = g / count
        stats_fn, grad_fn = _impl(hidden.device.type, backward=True)
        out = ref.chunk_loop(
            hidden,
            weight,
            target,
            row_grad=_row_grad(target != ctx.spec["ignore_index"], g).contiguous(),
            stats=(row_max, log_s),
            hidden_grad=ctx.needs_input_grad[0],
            weight_grad=ctx.needs_input_grad[1],
            local_stats=stats_fn,
            grad_fn=grad_fn,
            **ctx.spec,
        )
        grad_weight = out.grad_weight
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return out.grad_hidden, grad_weight, None, None, None


def _check(hidden, weight, target, reduction, label_smoothing, z_loss, chunk_size) -> None:
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must share one dtype of float32, bfloat16 or float16, got "
            f"{hidden.dtype} and {weight.dtype}; cast them first"
        )
    _check_target_dtype(target)
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
            "[..., H] and this rank's vocabulary shard [V_local, H]"
        )
    if tuple(hidden.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be target's shape {tuple(target.shape)} plus "
            "the hidden dimension: hidden [..., H], target [...]"
        )
    _check_options(reduction, label_smoothing, z_loss)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    reduce_hidden_grad: bool = True,
    recompute: bool = False,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(hidden, weight), target)`` without the logits.

    hidden ``[..., H]`` and weight ``[V_local, H]`` (this rank's contiguous vocabulary shard,
    rows past the global ``vocab_size``, default ``V_local·tp``, are padding) of one dtype
    (fp32 / bf16 / fp16); target ``[...]`` int64 global ids or ``ignore_index``. Loss, options
    and the fp32 result as ``vocab_parallel_cross_entropy``. ``group``: the TP group (default
    the world, or one process without torch.distributed): one ``[chunk, 4]`` fp32 all-gather
    per chunk in forward; in backward one all-reduce of d hidden ``[..., H]`` when
    ``reduce_hidden_grad`` (False: the caller's ``copy_to_region`` / sequence-parallel gather
    reduces it). ``chunk_size``: rows per chunk (default about 2^23 logits a chunk, the same on
    every rank). ``recompute``: recompute the logits in backward instead of computing the
    gradients in forward (always so for ``reduction="none"``). d weight is accumulated in fp32
    for bf16 / fp16 weights and cast once.
    """
    _check(hidden, weight, target, reduction, label_smoothing, z_loss, chunk_size)
    tp, rank = _group_info(group)
    n_local = weight.shape[0]
    if vocab_size is None:
        vocab_size = n_local * tp
    flat_target = target.reshape(-1).long()
    if tp > 1 and debug.enabled():  # one small all-reduce: catches what the free check can't
        check_same(
            OP,
            {
                "hidden shape": tuple(hidden.shape),
                "weight shape": tuple(weight.shape),
                "dtype": hidden.dtype,
                **_loss_fields(
                    vocab_size, ignore_index, flat_target, label_smoothing, z_loss, reduction
                ),
                "chunk_size": chunk_size or 0,
            },
            group,
            hidden.device,
            "every rank of the tensor-parallel group must pass the same rows (the same "
            "micro-batch), shards of ceil(vocab_size / tp) rows and the same options",
        )
    if tp > 1 and reduce_hidden_grad:
        hidden = copy_to_region(hidden, group)  # backward: all-reduce of d hidden over group
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    options = (
        tp,
        rank,
        vocab_size,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        reduction,
        chunk_size,
        recompute or reduction == "none",
        torch.is_grad_enabled(),  # under no_grad forward computes no gradient
    )
    loss = VocabParallelLinearCrossEntropyFunction.apply(
        flat_hidden, weight.contiguous(), flat_target, group, options
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
