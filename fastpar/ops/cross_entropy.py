"""Vocab-parallel cross-entropy: the autograd Function and the functional API. One all-gather of
``[N, 4]`` fp32 statistics in forward (with free cross-rank checks riding along), none in
backward (docs/kernels.md, "Vocab-parallel cross-entropy")."""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from fastpar import debug
from fastpar.comm import plain
from fastpar.comm.checks import check_same, digest, raise_if_disagree
from fastpar.ops import backend
from fastpar.reference import cross_entropy as ref
from fastpar.reference.precision import upcast

OP = "vocab_parallel_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
LOW_AND_FP32 = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_DTYPES = (*LOW_AND_FP32, torch.float64)  # float64: the exact reference, on the torch path

backend.register_op(
    OP,
    ("triton", "reference"),
    "cross-entropy over a vocabulary sharded across the TP group (one all-gather of [N, 4])",
)


def _impl(device_type: str, dtype: torch.dtype = torch.float32) -> Any:
    """The module that computes local stats and gradients: Triton kernels or the reference (the
    only one for float64, the exact reference of parity checks)."""
    if dtype != torch.float64 and backend.select(OP, device_type) == "triton":
        return importlib.import_module("fastpar.kernels.cross_entropy")
    return ref


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, rank) of ``group``; (1, 0) when torch.distributed is not initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


HEADER_ROWS = 2  # [N, 4] stats + 2 rows: (width, vocab_size, ignore_index, target digest)
_HEADER_FIELDS = ("shard width (logits.shape[-1])", "vocab_size", "ignore_index", "target ids")
_PIECE = 1 << 24  # 48-bit integers travel as two 24-bit halves, exact in fp32
_HINT = (
    "every rank must hold ceil(vocab_size / tp) columns (pad the last shard and pass "
    "vocab_size=) and the same target ids"
)


def _header(n_local: int, vocab_size: int, ignore_index: int, target: torch.Tensor) -> torch.Tensor:
    """This rank's fp32 ``[2, 4]`` header rows: every field as two exact 24-bit halves."""
    host = []
    for value in (n_local, vocab_size, ignore_index):
        value &= _PIECE * _PIECE - 1
        host += [float(value // _PIECE), float(value % _PIECE)]
    head = torch.tensor(host, dtype=torch.float32)
    if target.device.type == "cuda":  # no host sync: an asynchronous copy from pinned memory
        head = head.pin_memory().to(target.device, non_blocking=True)
    else:
        head = head.to(target.device)
    d = digest(target)
    tail = torch.stack([d // _PIECE, d % _PIECE]).to(torch.float32)
    return torch.cat([head, tail]).view(HEADER_ROWS, 4)


def _check_headers(headers: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank when the gathered ``[tp, 8]`` headers differ (see docs/kernels.md)."""
    bad = (headers != headers[0]).any()
    if headers.device.type != "cpu":
        torch._assert_async(
            ~bad,
            "vocab_parallel_cross_entropy: the ranks of the group disagree on the shard width, "
            f"vocab_size, ignore_index or target ids; {_HINT} (FASTPAR_DEBUG_CHECKS=1 names them)",
        )
        return
    if not bool(bad):
        return
    values = []
    for row in headers.tolist():
        ints = [int(row[i]) * _PIECE + int(row[i + 1]) for i in range(0, 8, 2)]
        ints[2] -= _PIECE * _PIECE if ints[2] >= _PIECE * _PIECE // 2 else 0  # sign
        values.append([str(v) for v in ints[:3]] + [f"digest {ints[3]:#014x}"])
    per_rank = {name: [v[i] for v in values] for i, name in enumerate(_HEADER_FIELDS)}
    raise_if_disagree("vocab_parallel_cross_entropy", per_rank, group, _HINT)


def _gather_stats(
    stats: torch.Tensor, header: torch.Tensor | None, tp: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """All-gather the ``[N, 4]`` stats (and header rows) of every rank of ``group``; check the
    headers agree; return the stats as ``[tp, N, 4]``."""
    if tp == 1:
        return stats.unsqueeze(0)
    n = stats.shape[0]
    send = torch.cat([stats, header.to(stats.dtype)])
    out = torch.empty((tp * (n + HEADER_ROWS), 4), dtype=stats.dtype, device=stats.device)
    plain.all_gather_into_tensor(out, send, group=group)  # gloo: concatenated
    out = out.view(tp, n + HEADER_ROWS, 4)
    _check_headers(out[:, n:].reshape(tp, 4 * HEADER_ROWS), group)
    return out[:, :n]


def _check_fit(n_local: int, tp: int, vocab_size: int) -> None:
    if not (n_local - 1) * tp < vocab_size <= n_local * tp:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit shards of {n_local} columns on {tp} ranks: "
            f"each rank must hold ceil(vocab_size / tp) columns, i.e. vocab_size in "
            f"({(n_local - 1) * tp}, {n_local * tp}]"
        )


def _check_ids(target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    torch._assert_async(
        ~bad.any(),
        f"vocab_parallel_cross_entropy: a target id is outside [0, {vocab_size}) and is not "
        f"ignore_index={ignore_index}; ids must index the global vocabulary",
    )


def _row_grad(valid: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each row's upstream gradient ``[N]``: ``g`` (a scalar or ``[N]``) where ``valid``, else 0."""
    return torch.where(valid, g.expand(valid.shape), torch.zeros((), device=valid.device))


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
        inplace_backward: bool = False,
    ) -> torch.Tensor:
        impl = _impl(logits.device.type, logits.dtype)
        n_local = logits.shape[1]
        vocab_start = rank * n_local
        n_valid = max(0, min(n_local, vocab_size - vocab_start))
        stats = impl.local_stats(logits, target, vocab_start, n_valid, ignore_index)
        header = _header(n_local, vocab_size, ignore_index, target) if tp > 1 else None
        gathered = _gather_stats(stats, header, tp, group)  # raises on every rank on mismatch
        # after the gather, so that every rank sees the same widths and targets and raises alike
        _check_fit(n_local, tp, vocab_size)
        _check_ids(target, vocab_size, ignore_index)
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
        ctx.reduction, ctx.inplace = reduction, inplace_backward
        if reduction == "none":
            return loss
        total = loss.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, target, row_max, log_s, count = ctx.saved_tensors
        vocab_start, n_valid, ignore_index, alpha, z_loss, vocab_size = ctx.args
        valid = target != ignore_index
        g = upcast(grad_out)
        if ctx.reduction == "mean":
            g = g / count
        grad = _impl(logits.device.type, logits.dtype).grad_logits(
            logits,
            target,
            row_max,
            log_s,
            _row_grad(valid, g).contiguous(),
            vocab_start=vocab_start,
            n_valid=n_valid,
            ignore_index=ignore_index,
            label_smoothing=alpha,
            z_loss=z_loss,
            vocab_size=vocab_size,
            in_place=ctx.inplace,
        )
        return (grad,) + (None,) * 10


def _check(
    logits: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
) -> None:
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"logits must be float32, bfloat16, float16 or float64, got {logits.dtype}; cast "
            "them first"
        )
    _check_target_dtype(target)
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be target's shape {tuple(target.shape)} plus a "
            "last dimension of this rank's vocabulary shard: logits [..., V_local], target [...]"
        )
    _check_options(reduction, label_smoothing, z_loss)


def _check_target_dtype(target: torch.Tensor) -> None:
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"target must hold integer class ids (int64), got {target.dtype}; "
            "pass target.long() if they are whole numbers"
        )


def _check_options(reduction: str, label_smoothing: float, z_loss: float) -> None:
    """The loss options shared with ``fastpar.ops.linear_cross_entropy``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if z_loss < 0.0:
        raise ValueError(f"z_loss must be >= 0 (a coefficient on lse²), got {z_loss}")


def _loss_fields(
    vocab_size: int,
    ignore_index: int,
    flat_target: torch.Tensor,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
) -> dict:
    """The loss's fields of the debug check (``check_same``), shared with the fused linear CE."""
    return {
        "vocab_size": vocab_size,
        "ignore_index": ignore_index,
        "target ids": digest(flat_target),
        "label_smoothing": float(label_smoothing),
        "z_loss": float(z_loss),
        "reduction": reduction,
    }


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
    inplace_backward: bool = False,
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

    ``inplace_backward``: the gradient overwrites the logits (when that is safe, and the ranks'
    agreement checks: docs/kernels.md, "Vocab-parallel cross-entropy").
    """
    _check(logits, target, reduction, label_smoothing, z_loss)
    tp, rank = _group_info(group)
    n_local = logits.shape[-1]
    if vocab_size is None:
        vocab_size = n_local * tp
    flat_logits = logits.reshape(-1, n_local).contiguous()
    flat_target = target.reshape(-1).long()
    if tp > 1 and debug.enabled():  # one small all-reduce: catches what the free check can't
        check_same(
            "vocab_parallel_cross_entropy",
            {
                "logits shape": tuple(logits.shape),
                "logits dtype": logits.dtype,
                **_loss_fields(
                    vocab_size, ignore_index, flat_target, label_smoothing, z_loss, reduction
                ),
            },
            group,
            logits.device,
            "every rank of the tensor-parallel group must pass the same rows (the same "
            "micro-batch), shard widths of ceil(vocab_size / tp) and the same options",
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
        bool(inplace_backward),
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
