"""The folded mixed-precision step against the unscaling one, on one small MLP: ``pair`` (the
model and optimizer of each, from the same weights), ``train`` (steps, an inf gradient at one
step on one rank), ``assert_same`` (bit for bit: parameters, masters, optimizer state, norms,
skipped steps, scaler)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.amp import DynamicLossScaler
from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer


def mlp(dtype: torch.dtype, fp32_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 16), nn.LayerNorm(16))
    model = model.to(dtype)
    if fp32_norm:
        model[3].float()  # a mixed model: fp32 LayerNorm, low-precision linears
    return model


def batch(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model[2](model[1](model[0](x.to(model[0].weight.dtype))))
    return model[3](h.to(model[3].weight.dtype)).float()


def pair(
    dtype,
    *,
    scaler: bool,
    fp32_norm: bool = False,
    max_grad_norm: float = 0.05,
    device: str = "cpu",
):
    """(model, optimizer) for the unscaling and the folded step, from the same weights."""
    out = []
    base = mlp(dtype, fp32_norm).to(device)
    for fold in (False, None):
        model = copy.deepcopy(base)
        matrices = [p for p in model.parameters() if p.dim() == 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]  # a second param group
        groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
        inner = FusedAdamW(groups, lr=1e-2, weight_decay=0.1)
        sc = DynamicLossScaler(initial_scale=2.0**12, hysteresis=1, device=device)
        sc = sc if scaler else None
        opt = MixedPrecisionOptimizer(
            inner, scaler=sc, max_grad_norm=max_grad_norm, fold_unscale=fold
        )
        out.append((model, opt))
    assert not out[0][1].fold_unscale and out[1][1].fold_unscale
    return out


def train(model, opt, steps: int, inf_at: int | None, rank: int = 0, inf_rank: int = 0):
    results = []
    for step in range(steps):
        x, y = (t.to(model[0].weight.device) for t in batch(step, rank))
        opt.scale_loss(F.mse_loss(forward(model, x), y)).backward()
        if step == inf_at and rank == inf_rank:
            model[0].weight.grad.view(-1)[-1] = float("inf")
        skipped, norm = opt.step()
        results.append((skipped.clone(), norm.clone()))
        opt.zero_grad()
    return results


def assert_same(a, b) -> None:
    """Bit for bit, on purpose: both steps run the same fp32 arithmetic in the same order. The
    norm is the sum of squares of the same products fp32(g)·inv_scale, the read-only pass
    taking the writing pass's per-tensor sums in the same order (``fastpar.optim.
    mixed_precision``); AdamW sees the same gradient, fp32(g)·inv_scale then ·clip_coef,
    whether the unscale pass stored the first product or FusedAdamW forms both; the rest is the
    same elementwise update. No reduction runs in another order, so no machine's rounding
    enters (a difference is a defect of the folding, not rounding)."""
    (model_a, opt_a, res_a), (model_b, opt_b, res_b) = a, b
    for (sa, na), (sb, nb) in zip(res_a, res_b, strict=True):
        assert torch.equal(sa, sb)
        assert torch.equal(na, nb) or (torch.isnan(na) and torch.isnan(nb)), (na, nb)
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
    for m, n in zip(opt_a.masters, opt_b.masters, strict=True):
        assert torch.equal(m, n)
    assert len(opt_a.param_groups) == 2
    state_a, state_b = opt_a.optimizer.state, opt_b.optimizer.state
    for m, n in zip(opt_a.masters, opt_b.masters, strict=True):
        assert state_a[m].keys() == state_b[n].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in state_a[m]:
            assert torch.equal(state_a[m][key], state_b[n][key]), key
    assert torch.equal(opt_a.skipped_steps, opt_b.skipped_steps)
    if opt_a.scaler is not None:
        for key, value in opt_a.scaler.state_dict().items():
            assert torch.equal(value, opt_b.scaler.state_dict()[key]), key
