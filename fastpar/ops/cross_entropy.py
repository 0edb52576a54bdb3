"""Vocab-parallel cross-entropy: the autograd Function and the functional API.

Each rank of a tensor-parallel group holds a contiguous shard of the vocabulary (the layout of
``VocabParallelEmbedding`` / ``ColumnParallelLinear``): with ``tp`` ranks and a global vocabulary
``V``, every rank has ``V_local = ceil(V / tp)`` columns and rank ``r`` owns global ids
``[r·V_local, (r+1)·V_local)``; ids ``>= V`` are padding and never enter the loss.

Forward: one local pass per row (Triton kernel on CUDA, torch reference on CPU) gives fp32
statistics ``[N, 4]``; ONE ``all_gather_into_tensor`` over ``group`` exchanges them (``16·N``
bytes sent per rank, nothing when the group has one rank); every rank then forms the same
per-row log-sum-exp and loss. Backward communicates nothing: it recomputes the softmax of its
own shard from the saved logits and per-row max and log-sum-exp. No ``.item()`` or host synchronisation anywhere.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from fastpar.ops import backend
from fastpar.reference import cross_entropy as ref

OP = "vocab_parallel_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

backend.register_op(
    OP,
    ("triton", "reference"),
    "cross-entropy over a vocabulary sharded across the TP group (one all-gather of [N, 4])",
)


def _impl(device_type: str) -> Any:
    """The module that computes local stats and gradients: Triton kernels or the reference."""
    if backend.select(OP, device_type) == "triton":
        return importlib.import_module("fastpar.kernels.cross_entropy")
    return ref


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, rank) of ``group``; (1, 0) when torch.distributed is not initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gather_stats(stats: torch.Tensor, tp: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the ``[N, 4]`` stats of every rank of ``group`` into ``[tp, N, 4]``."""
    if tp == 1:
        return stats.unsqueeze(0)
    n = stats.shape[0]
    out = torch.empty((tp * n, 4), dtype=stats.dtype, device=stats.device)  # gloo: concatenated
    dist.all_gather_into_tensor(out, stats.contiguous(), group=group)
    return out.view(tp, n, 4)


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Loss of logits ``[N, V_local]`` (a vocabulary shard) against global ids ``[N]``.

    Returns fp32: ``[N]`` per-row losses for ``reduction="none"``, else a scalar. Forward
    all-gathers the per-row statistics over ``group``; backward needs no communication.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup | None,
        tp: int,
        rank: int,
        vocab_size: int,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
        z_loss: float,
    ) -> torch.Tensor:
        impl = _impl(logits.device.type)
        n_local = logits.shape[1]
        vocab_start = rank * n_local
        n_valid = max(0, min(n_local, vocab_size - vocab_start))
        stats = impl.local_stats(logits, target, vocab_start, n_valid, ignore_index)
        gathered = _gather_stats(stats, tp, group)
        row_max, log_s, target_logit, logit_sum = ref.combine_stats(gathered)
        valid = target != ignore_index
        loss = ref.row_loss(
            row_max,
            log_s,
            target_logit,
            logit_sum,
            valid,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            vocab_size=vocab_size,
        )
        count = valid.sum().clamp(min=1).float()
        ctx.save_for_backward(logits, target, row_max, log_s, count)
        ctx.args = (vocab_start, n_valid, ignore_index, label_smoothing, z_loss, vocab_size)
        ctx.reduction = reduction
        if reduction == "none":
            return loss
        total = loss.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, target, row_max, log_s, count = ctx.saved_tensors
        vocab_start, n_valid, ignore_index, alpha, z_loss, vocab_size = ctx.args
        valid = target != ignore_index
        g = grad_out.float()
        if ctx.reduction == "mean":
            g = g / count
        row_grad = torch.where(valid, g.expand(valid.shape), torch.zeros((), device=g.device))
        grad = _impl(logits.device.type).grad_logits(
            logits,
            target,
            row_max,
            log_s,
            row_grad.contiguous(),
            vocab_start=vocab_start,
            n_valid=n_valid,
            ignore_index=ignore_index,
            label_smoothing=alpha,
            z_loss=z_loss,
            vocab_size=vocab_size,
        )
        return (grad,) + (None,) * 9


def _check(
    logits: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
) -> None:
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"logits must be float32, bfloat16 or float16, got {logits.dtype}; cast them first"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"target must hold integer class ids (int64), got {target.dtype}; "
            "pass target.long() if they are whole numbers"
        )
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be target's shape {tuple(target.shape)} plus a "
            "last dimension of this rank's vocabulary shard: logits [..., V_local], target [...]"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if z_loss < 0.0:
        raise ValueError(f"z_loss must be >= 0 (a coefficient on lse²), got {z_loss}")


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits, equal to ``F.cross_entropy`` on the full ones.

    logits ``[..., V_local]`` (fp32 / bf16 / fp16): this rank's contiguous vocabulary shard,
    ``V_local = ceil(V / tp)``; columns past the global ``vocab_size`` (default ``V_local·tp``)
    are padding and are ignored. target ``[...]`` int64 global ids in ``[0, V)`` or
    ``ignore_index``. ``group``: the tensor-parallel group (default: the world, or a single
    process when torch.distributed is not initialised); forward all-gathers ``[N, 4]`` fp32
    stats over it, backward communicates nothing.

    Per non-ignored row: ``lse − (1−α)·x_t − (α/V)·Σ_j x_j + z_loss·lse²`` (label smoothing over
    the global vocabulary). ``reduction``: "mean" over non-ignored rows (0 when all are ignored),
    "sum", or "none" (shape of ``target``, 0 at ignored rows). The loss is always fp32; the
    gradient has the logits' dtype.
    """
    _check(logits, target, reduction, label_smoothing, z_loss)
    tp, rank = _group_info(group)
    n_local = logits.shape[-1]
    if vocab_size is None:
        vocab_size = n_local * tp
    elif not ((n_local - 1) * tp < vocab_size <= n_local * tp):
        raise ValueError(
            f"vocab_size={vocab_size} does not fit shards of {n_local} columns on {tp} ranks: "
            f"each rank must hold ceil(vocab_size / tp) columns, i.e. vocab_size in "
            f"({(n_local - 1) * tp}, {n_local * tp}]"
        )
    flat_logits = logits.reshape(-1, n_local).contiguous()
    flat_target = target.reshape(-1).long()
    bad = (flat_target != ignore_index) & ((flat_target < 0) | (flat_target >= vocab_size))
    torch._assert_async(
        ~bad.any(),
        f"vocab_parallel_cross_entropy: a target id is outside [0, {vocab_size}) and is not "
        f"ignore_index={ignore_index}; ids must index the global vocabulary",
    )
    loss = VocabParallelCrossEntropyFunction.apply(
        flat_logits,
        flat_target,
        group,
        tp,
        rank,
        vocab_size,
        ignore_index,
        float(label_smoothing),
        reduction,
        float(z_loss),
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
