"""The AdamW oracles of the optimizer tests, one tensor at a time:

    p, m, v = torch_adamw(p0, grads, lr=1e-3, eps=1e-8, beta1=0.9, weight_decay=0.1)   # fp32
    p, m, v = exact_adamw(p0, grads, lr=1e-3, eps=1e-8, beta1=0.9, beta2=0.999,
                          weight_decay=0.1)                                         # float64

``torch_adamw`` is ``torch.optim.AdamW(foreach=False)`` itself, the fp32 run a kernel or
fastpar's reference must match (bit for bit where both run torch's elementwise ops in torch's
order). ``exact_adamw`` writes the update out in float64, the exact math a rounding run is
judged against by ``fastpar.tolerance``'s rule (``fastpar.reference.adamw`` computes in fp32
whatever its inputs, so a float64 run of it is not exact). For whole models,
``fastpar.tolerance.train_references`` (AdamW) and tests/_training.py (any optimizer).
``same_fmas()``: whether a kernel's moment updates and torch's CPU ones round alike here (then
the moments are compared bit for bit).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable

import torch

Pre = Callable[[torch.Tensor], torch.Tensor] | None


def torch_adamw(
    p0: torch.Tensor,
    grads: Iterable[torch.Tensor],
    *,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float = 0.999,
    weight_decay: float,
    maximize: bool = False,
    pre: Pre = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.optim.AdamW(foreach=False)`` on an fp32 copy of ``p0``, one step per gradient,
    fed ``pre(fp32(g))`` (``fp32(g)`` without ``pre``); returns (p, exp_avg, exp_avg_sq)."""
    p = p0.clone().requires_grad_()
    opt = torch.optim.AdamW(
        [p],
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
        foreach=False,
    )
    for g in grads:
        g = g.float()
        p.grad = g if pre is None else pre(g)
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def exact_adamw_step(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    t: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW's step ``t`` (1 on the first) in float64 from (p, m, v) with gradient ``g`` (all
    float64): decoupled decay, the moments, the bias-corrected update; returns the new (p, m,
    v)."""
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - lr / (1.0 - beta1**t) * m / (v.sqrt() / math.sqrt(1.0 - beta2**t) + eps)
    return p, m, v


def exact_adamw(
    p0: torch.Tensor,
    grads: Iterable[torch.Tensor],
    *,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
    pre: Pre = None,
    steps_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW written out in float64: (p, m, v) after ``grads`` (each ``pre(float64(g))`` when
    given, negated when ``maximize``) from steps ``steps_from`` + 1 on, the moments from zero."""
    p = p0.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    for t, g in enumerate(grads, start=steps_from + 1):
        g = g.double().to(p.device)
        g = g if pre is None else pre(g)
        g = -g if maximize else g
        p, m, v = exact_adamw_step(p, m, v, g, t, **hyper)
    return p, m, v


@functools.cache
def fma_rounds_once() -> bool:
    """Whether ``tl.fma`` rounds once here: fma(a, a, -(1 + 2^-11)) with a = 1 + 2^-12 is
    2^-24 exactly, but 0 when a·a is first rounded to fp32 (1 + 2^-11, a tie to even)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr, c_ptr, out_ptr):
        tl.store(out_ptr, tl.fma(tl.load(a_ptr), tl.load(a_ptr), tl.load(c_ptr)))

    out = torch.zeros(1)
    probe[(1,)](torch.tensor([1 + 2.0**-12]), torch.tensor([-(1 + 2.0**-11)]), out)
    return out.item() == 2.0**-24


# c + a·a and c + w·(end − c) are 2^-24 exactly, 0 when the product is rounded first
PROBE_A, PROBE_C = 1 + 2.0**-12, -(1 + 2.0**-11)
PROBE_END, PROBE_W = 3 + 2.0**-11, 0.25 + 2.0**-14  # end − c = 4 + 2^-10, w·(end − c) = a·a


@functools.cache
def torch_cpu_fuses() -> bool:
    """Whether torch's CPU lerp and addcmul (the reference's and torch.optim.AdamW's moment
    updates) round each multiply-add once, as its AVX2 / AVX-512 kernels do (its portable
    kernels, ``ATEN_CPU_CAPABILITY=default``, round the product first)."""
    c = torch.full((17,), PROBE_C)  # a vectorised part and a scalar tail
    lerp = torch.lerp(c, torch.full_like(c, PROBE_END), PROBE_W)
    fma = c.clone().addcmul_(torch.full_like(c, PROBE_A), torch.full_like(c, PROBE_A))
    return bool((lerp == 2.0**-24).all() and (fma == 2.0**-24).all())


def same_fmas() -> bool:
    """Whether the kernel's moment updates and torch's CPU ones are the same operations with the
    same roundings (then the moments are bit for bit the same)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return torch_cpu_fuses() and (not interpreted or fma_rounds_once())
