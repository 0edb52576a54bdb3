"""The training command's optimizer step in float64: the exact reference of ``fastpar.verify``.

The trainer's step (the global norm, clipping by ``min(1, max / (norm + 1e-6))``, AdamW per
parameter group) in float64 with ``torch.optim.AdamW``, skipping exactly the steps the run under
test skipped; with bf16 moments, rounded as the run stores them (``rounding_slack``:
docs/tolerances.md, "bf16 optimizer state").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CLIP_EPS = 1e-6
"""The clip coefficient's eps: ``min(1, max_norm / (norm + eps))`` (fastpar.amp, torch)."""


class ExactAdamW:
    """``fastpar.amp.AmpOptimizer`` in float64 over ``param_groups`` (dicts as for torch
    optimizers: ``params``, and ``weight_decay`` / ``lr`` / ``betas`` / ``eps`` overrides).
    ``skips``: which steps to skip (True at index i: step i + 1), e.g. an fp16 run's decisions.
    After each step ``denominators`` gains {parameter: sqrt(v̂) + eps} (float64), what AdamW
    divided each gradient by (``fastpar.tolerance.adam_slack``)."""

    scaler = None

    def __init__(
        self,
        param_groups: Sequence[dict],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        skips: Sequence[bool] = (),
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        for group in param_groups:
            for p in group["params"]:
                if p.dtype != torch.float64:
                    raise TypeError(f"ExactAdamW steps float64 parameters, got {p.dtype}")
        self.optimizer = torch.optim.AdamW(
            param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
        self.max_grad_norm, self.skips = max_grad_norm, list(skips)
        self.steps_taken = 0
        self._skipped = torch.zeros((), dtype=torch.int64)
        self.denominators: list[dict[torch.Tensor, torch.Tensor]] = []
        # bf16 moments: stored rounded; per parameter the bound on what a neighbouring stored
        # value moves it by (summed over the steps), and the moments' carried differences
        self.rounded = state_dtype == torch.bfloat16
        self.rounding_slack: dict[torch.Tensor, torch.Tensor] = {}
        self._carried: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def skipped_steps(self) -> torch.Tensor:
        return self._skipped

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(skipped, the gradients' L2 norm before clipping), both 0-dim."""
        grads = [p.grad for p in self._params() if p.grad is not None]
        norm = (
            torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
            if grads
            else torch.zeros((), dtype=torch.float64)
        )
        i, self.steps_taken = self.steps_taken, self.steps_taken + 1
        skip = i < len(self.skips) and bool(self.skips[i])
        if skip:
            self._skipped += 1
            self.denominators.append(self._denominators())
            return torch.tensor(True), norm
        if self.max_grad_norm is not None:
            coef = torch.clamp(self.max_grad_norm / (norm + CLIP_EPS), max=1.0)
            for g in grads:
                g.mul_(coef)
        self.optimizer.step()
        self.denominators.append(self._denominators())
        if self.rounded:
            self._round_moments()
        return torch.tensor(False), norm

    def _round_moments(self) -> None:
        """Store every moment rounded to bf16 (the update used the unrounded values), and add
        to ``rounding_slack`` the bound of this step's update's change when the run's stored
        moments differ from these by what earlier steps carried: ``E`` (decayed by beta each
        step, grown by one bf16 spacing at each rounding: two values ``d`` apart round at most
        ``d`` + one spacing apart). The update lr · m̂ / (sqrt(v̂) + eps) moves by at most
        lr · (E_m̂ / D + |m̂| · E_sqrt(v̂) / D²), D = sqrt(v̂) + eps."""
        for group in self.param_groups:
            (beta1, beta2), eps, lr = group["betas"], group["eps"], group["lr"]
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if not state:
                    continue
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                em, ev = self._carried.get(p, (torch.zeros_like(m), torch.zeros_like(v)))
                c1, c2 = 1.0 - beta1**t, 1.0 - beta2**t
                m_hat, v_hat, dv = m.abs() / c1, v / c2, ev / c2
                root = v_hat.sqrt()
                d_root = dv / torch.maximum(root, dv.sqrt()).clamp(min=1e-300)  # >= |Δ sqrt|
                denom = root + eps
                term = lr * (em / c1 / denom + m_hat * d_root / denom.square())
                self.rounding_slack[p] = self.rounding_slack.get(p, 0.0) + term
                rm, rv = m.to(torch.bfloat16).double(), v.to(torch.bfloat16).double()
                em = beta1 * (em + _bf16_spacing(torch.maximum(m.abs(), rm.abs())))
                ev = beta2 * (ev + _bf16_spacing(torch.maximum(v, rv)))
                self._carried[p] = (em, ev)
                m.copy_(rm)
                v.copy_(rv)

    def _denominators(self) -> dict[torch.Tensor, torch.Tensor]:
        out = {}
        for group in self.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if not state:
                    continue
                t = float(state["step"])
                out[p] = (state["exp_avg_sq"] / (1.0 - beta2**t)).sqrt() + eps
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance between neighbouring bf16 numbers around ``|x|`` (float64; 0 at 0): 2^(e-8)
    for |x| in [2^(e-1), 2^e) (8 significant bits), at least the smallest subnormal."""
    _, e = torch.frexp(x.abs())
    return torch.where(x == 0, 0.0, torch.ldexp(torch.ones_like(x), e - 8).clamp(min=2.0**-133))
