"""Pure-torch reference of the fused AdamW step: the CPU path and the oracle of the Triton kernel,
bit-identical to ``torch.optim.AdamW`` on a CPU. The per-element math: docs/kernels.md
("AdamW")."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def step_scalars(
    step: torch.Tensor, lr: float, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim fp32 ``(−lr / (1 − β1^t), sqrt(1 − β2^t))`` on step's device, computed in float64.

    step: 0-dim (or one-element) int64 / fp32 tensor holding t, the step number of this update.
    """
    t = step.reshape(()).to(torch.float64)
    neg_step_size = -(lr / (1.0 - beta1**t))
    bias_correction2_sqrt = (1.0 - beta2**t).sqrt()
    return neg_step_size.to(torch.float32), bias_correction2_sqrt.to(torch.float32)


def _skip_on_host(found_inf: torch.Tensor | None) -> bool | None:
    """True/False when the flag can be read for free (CPU), None when it lives on a device."""
    if found_inf is None:
        return False
    if found_inf.device.type == "cpu":
        return bool(found_inf.reshape(()) != 0)
    return None


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: torch.Tensor,
    inv_scale: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    param_lp: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """One AdamW update of one tensor, in place (see docs/kernels.md for the math).

    param / exp_avg / exp_avg_sq: fp32, any shapes and strides, same numel. grad: same numel, fp32 / bf16 /
    fp16 (still loss-scaled; multiplied by ``inv_scale`` and ``clip_coef`` here). step: 0-dim
    device tensor, the step number *after* this update (1 on the first). inv_scale, clip_coef,
    found_inf: 0-dim fp32 device tensors or None; a nonzero ``found_inf`` leaves every tensor
    unchanged. param_lp: optional bf16/fp16 tensor of the same numel, set to the new param.
    """
    skip = _skip_on_host(found_inf)
    if skip or param.numel() == 0:
        return
    shape = param.shape
    dst = (param, exp_avg, exp_avg_sq, param_lp)
    # work in param's shape: views where possible (always for param), copies otherwise
    work = [None if t is None else t.reshape(shape) for t in dst]
    if skip is None:  # the flag is on a device: compute on copies, keep the old values on a skip
        work = [None if w is None else w.clone() for w in work]
    _update(
        work[0],
        grad.reshape(shape),
        work[1],
        work[2],
        work[3],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        inv_scale=inv_scale,
        clip_coef=clip_coef,
        maximize=maximize,
    )
    keep = found_inf.reshape(()) != 0 if skip is None else None
    for t, w in zip(dst, work, strict=True):
        if t is None:
            continue
        if keep is not None:
            t.copy_(torch.where(keep, t, w.reshape(t.shape)))
        elif w.data_ptr() != t.data_ptr():  # reshape had to copy: write the result back
            t.copy_(w.reshape(t.shape))


def _update(
    p: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lp: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: torch.Tensor,
    inv_scale: torch.Tensor | None,
    clip_coef: torch.Tensor | None,
    maximize: bool,
) -> None:
    """The update on tensors of one shape, in torch.optim.AdamW's order of operations."""
    g = grad if grad.dtype == torch.float32 else grad.float()
    if inv_scale is not None:
        g = g * inv_scale.reshape(()).to(torch.float32)
    if clip_coef is not None:
        g = g * clip_coef.reshape(()).to(torch.float32)
    if maximize:
        g = -g
    neg_step_size, bias_correction2_sqrt = step_scalars(step, lr, beta1, beta2)
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.add_((m * neg_step_size).div_(denom))  # torch's CPU addcdiv_: p + (value · m) / denom
    if lp is not None:
        lp.copy_(p)


def adamw_step_multi_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    steps: Sequence[torch.Tensor],
    inv_scale: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    params_lp: Sequence[torch.Tensor | None] | None = None,
    maximize: bool = False,
) -> None:
    """``adamw_step_`` over lists of tensors (one step tensor per param); loops."""
    lps = [None] * len(params) if params_lp is None else list(params_lp)
    for p, g, m, v, t, lp in zip(params, grads, exp_avgs, exp_avg_sqs, steps, lps, strict=True):
        adamw_step_(
            p,
            g,
            m,
            v,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            step=t,
            inv_scale=inv_scale,
            clip_coef=clip_coef,
            found_inf=found_inf,
            param_lp=lp,
            maximize=maximize,
        )
