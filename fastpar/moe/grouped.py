"""Grouped (segmented) linear layer over expert-major rows: the dropless experts' compute, with no
host sync on the traced path, so ``torch.compile`` traces a dropless MoE layer whole.

    y = grouped_linear(x, w, bias, offs)   # x [N, K] grouped by offs, w [G, K, M] -> [N, M]

``offs [G]`` int32: cumulative row counts on the device (``offsets(counts)``). Backends and
custom ops: docs/moe.md ("Experts")."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

_GMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """``counts [G]`` rows per group -> ``offs [G]`` int32 (their inclusive prefix sum)."""
    return torch.cumsum(counts, 0).to(torch.int32)


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(
        n <= 1 or s == 1 or (s > 0 and (s * size) % 16 == 0)
        for s, n in zip(t.stride(), t.shape, strict=True)
    )


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows form ``a [N, K] @ b [G, K, M] -> [N, M]``, or weights form ``a [K, N] @ b [N, M]
    -> [G, K, M]`` (group g: ``a[:, rows g] @ b[rows g]``; zeros when empty)."""
    if (
        hasattr(torch, "_grouped_mm")
        and a.dtype in _GMM_DTYPES
        and b.dtype == a.dtype
        and a.numel() > 0
        and b.numel() > 0
        and _aligned(a)
        and _aligned(b)
    ):
        try:
            return torch._grouped_mm(a, b, offs=offs)
        except RuntimeError:  # a layout or device this torch's kernel refuses: the loop
            pass
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[2])
        for g, (lo, hi) in enumerate(_bounds(offs)):
            if hi > lo:
                torch.mm(a[lo:hi], b[g], out=out[lo:hi])
        return out
    out = a.new_zeros(offs.shape[0], a.shape[0], b.shape[1])
    for g, (lo, hi) in enumerate(_bounds(offs)):
        if hi > lo:
            torch.mm(a[:, lo:hi], b[lo:hi], out=out[g])
    return out


def _row_groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    groups = torch.arange(offs.shape[0], device=offs.device)
    return torch.repeat_interleave(groups, counts, output_size=rows)


def _forward(x, w, bias, offs) -> torch.Tensor:
    y = _mm(x, w, offs)
    if bias is not None:
        if offs.device.type == "cpu":
            for g, (lo, hi) in enumerate(_bounds(offs)):
                y[lo:hi] += bias[g]
        else:
            y += bias.index_select(0, _row_groups(offs, y.shape[0]))
    return y


def _backward(grad, x, w, offs, has_bias: bool, need_x: bool, need_w: bool):
    grad = grad.contiguous()
    dx = _mm(grad, w.transpose(1, 2), offs) if need_x else grad.new_empty(0)
    dw = _mm(x.t(), grad, offs) if need_w else grad.new_empty(0)
    db = grad.new_empty(0)
    if has_bias:
        if grad.device.type == "cpu":
            db = grad.new_zeros(offs.shape[0], grad.shape[1])
            for g, (lo, hi) in enumerate(_bounds(offs)):
                if hi > lo:
                    db[g] = grad[lo:hi].sum(0)
        else:
            db = _mm(grad.new_ones(1, grad.shape[0]), grad, offs).squeeze(1)
    return dx, dw, db


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, offs):
        ctx.save_for_backward(x, w, offs)
        ctx.has_bias = bias is not None
        return _forward(x, w, bias, offs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx, dw, db = _backward(grad, x, w, offs, ctx.has_bias, need_x, need_w)
        return (dx if need_x else None), (dw if need_w else None), (db if need_b else None), None


@torch.library.custom_op("fastpar::grouped_linear", mutates_args=())
def _op(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, offs: torch.Tensor
) -> torch.Tensor:
    return _forward(x, w, bias, offs)


@_op.register_fake
def _op_fake(x, w, bias, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("fastpar::grouped_linear_backward", mutates_args=())
def _op_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    has_bias: bool,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad, x, w, offs, has_bias, need_x, need_w)


@_op_backward.register_fake
def _op_backward_fake(grad, x, w, offs, has_bias, need_x, need_w):
    return (
        x.new_empty(x.shape) if need_x else grad.new_empty(0),
        w.new_empty(w.shape) if need_w else grad.new_empty(0),
        grad.new_empty(w.shape[0], w.shape[2]) if has_bias else grad.new_empty(0),
    )


def _op_setup(ctx, inputs, output):
    x, w, bias, offs = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.has_bias = bias is not None


def _op_autograd(ctx, grad):
    x, w, offs = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx, dw, db = _op_backward(grad, x, w, offs, ctx.has_bias, need_x, need_w)
    return (dx if need_x else None), (dw if need_w else None), (db if need_b else None), None


_op.register_autograd(_op_autograd, setup_context=_op_setup)


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, offs: torch.Tensor
) -> torch.Tensor:
    """``x [N, K]`` grouped by ``offs [G]`` (int32, see ``offsets``) -> ``x_g @ w[g]
    (+ bias[g])`` ``[N, M]``; ``w [G, K, M]``, ``bias [G, M]`` or None. Differentiable in
    ``x``, ``w`` and ``bias`` (once). Same dtype for all; computes in it (no upcast)."""
    if torch.compiler.is_compiling():
        return _op(x, w, bias, offs)
    return _GroupedLinear.apply(x, w, bias, offs)
