"""``FusedAdamW``: torch.optim.AdamW on ``fastpar.ops.adamw_step_multi_`` (one pass per group),
bit for bit ``torch.optim.AdamW(foreach=False)`` on a CPU.

    opt = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loss.backward(); opt.step(); opt.zero_grad()

Mixed precision without a host sync (``found_inf``, ``grad_scale``, ``clip_coef``, ``amp_step``),
bf16 moments (``state_dtype=torch.bfloat16``): docs/kernels.md ("AdamW")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fastpar.ops.adamw import MOMENT_DTYPES, adamw_step_multi_

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay over fp32 parameters (any shapes, any devices).

    Per-parameter state: ``"step"`` (0-dim fp32 tensor on the parameter's device),
    ``"exp_avg"``, ``"exp_avg_sq"`` (the parameter's shape, in ``state_dtype``: fp32 as
    torch.optim.AdamW, or bf16 — updated in fp32, stored rounded to nearest even).
    Param groups may override ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``maximize``.
    Use fp32 parameters (for bf16/fp16 models wrap in ``MixedPrecisionOptimizer``, which keeps
    fp32 masters).
    """

    _step_supports_amp_scaling = True
    amp_step_takes_grads = True  # fastpar.amp.FoldedAmpStep

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        maximize: bool = False,
        *,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        if state_dtype not in MOMENT_DTYPES:
            raise TypeError(
                f"state_dtype {state_dtype} is not supported: use torch.float32 or torch.bfloat16"
            )
        self.state_dtype = state_dtype
        if isinstance(lr, torch.Tensor):
            raise TypeError("lr must be a python float, not a tensor")
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must lie in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The base class's, then every ``"step"`` moved to its parameter's device as fp32 and
        the moments kept in ``state_dtype``. Moments saved in another dtype are refused (a
        TypeError): converting them would change the run's math without saying so; build the
        optimizer with the state's dtype (``--optimizer-state-dtype``) instead."""
        for index, entry in state_dict["state"].items():
            for key in MOMENT_KEYS:
                t = entry.get(key)
                if torch.is_tensor(t) and t.dtype != self.state_dtype:
                    raise TypeError(
                        f"the saved state of parameter {index} holds {key} in {t.dtype}, this "
                        f"FusedAdamW keeps its moments in {self.state_dtype}: build it with "
                        f"state_dtype={t.dtype} (--optimizer-state-dtype) to load this state"
                    )
        super().load_state_dict(state_dict)  # (casts every tensor to its parameter's dtype)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
                for key in MOMENT_KEYS:  # bf16 -> fp32 -> bf16: exact
                    if state and torch.is_tensor(state.get(key)):
                        state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient, under the amp attributes when set
        (docs/kernels.md); returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update(
            found_inf=getattr(self, "found_inf", None),
            grad_scale=getattr(self, "grad_scale", None),
            clip_coef=getattr(self, "clip_coef", None),
        )
        return loss

    @torch.no_grad()
    def amp_step(
        self,
        *,
        found_inf: torch.Tensor | None = None,
        inv_scale: torch.Tensor | None = None,
        clip_coef: torch.Tensor | None = None,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """One update with the mixed-precision scalars as arguments (0-dim tensors or None):
        skipped on the device where ``found_inf`` is nonzero, gradients multiplied by
        ``inv_scale`` then ``clip_coef``. ``grads``: parameter -> the gradient to use instead
        of its ``.grad`` (fp32 / bf16 / fp16, the parameter's shape). Reads no amp attribute."""
        self._update(found_inf=found_inf, inv_scale=inv_scale, clip_coef=clip_coef, grad_of=grads)

    def _update(
        self,
        *,
        found_inf: Any = None,
        grad_scale: Any = None,
        inv_scale: Any = None,
        clip_coef: Any = None,
        grad_of: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        for group in self.param_groups:
            by_device: dict[torch.device, tuple[list, ...]] = {}
            for p in group["params"]:
                grad = p.grad if grad_of is None else grad_of.get(p, p.grad)
                if grad is None:
                    continue
                if grad.shape != p.shape:
                    raise ValueError(
                        f"a gradient of shape {tuple(grad.shape)} for a parameter of shape "
                        f"{tuple(p.shape)}"
                    )
                if grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                if p.dtype != torch.float32:
                    raise TypeError(
                        f"FusedAdamW updates fp32 parameters, got {p.dtype}; keep fp32 masters "
                        "(fastpar.optim.MixedPrecisionOptimizer) for a bf16/fp16 model"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    for key in MOMENT_KEYS:
                        state[key] = torch.zeros_like(
                            p, dtype=self.state_dtype, memory_format=torch.preserve_format
                        )
                lists = by_device.setdefault(p.device, ([], [], [], [], []))
                for lst, t in zip(
                    lists,
                    (p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"]),
                    strict=True,
                ):
                    lst.append(t)
            beta1, beta2 = group["betas"]
            for device, (params, grads, exp_avgs, exp_avg_sqs, steps) in by_device.items():
                inv, clip, found = _on(device, inv_scale, clip_coef, found_inf)
                if grad_scale is not None:
                    inv = torch.reciprocal(_on(device, grad_scale)[0])
                if found is None:
                    torch._foreach_add_(steps, 1.0)
                else:
                    torch._foreach_add_(steps, (found == 0).to(torch.float32))
                adamw_step_multi_(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    steps=steps,
                    inv_scale=inv,
                    clip_coef=clip,
                    found_inf=found,
                    maximize=group["maximize"],
                )


def _on(device: torch.device, *scalars: Any) -> list[torch.Tensor | None]:
    """Each scalar as a 0-dim fp32 tensor on ``device`` (None stays None)."""
    return [
        None if t is None else t.to(device=device, dtype=torch.float32).reshape(()) for t in scalars
    ]
