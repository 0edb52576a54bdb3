"""The mixed-precision step shared by every fastpar optimizer wrapper (``MixedPrecisionOptimizer``
and the data-parallel family, stages 0-3): one fused unscale + inf-check + norm pass (or its
read-only folded form), agreement over every rank, the scaler update, clipping, and the wrapped
optimizer's step, skipped on the device when it can (docs/layouts.md, "Mixed precision")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from fastpar.amp.norm import all_reduce_norm_and_inf
from fastpar.amp.protocols import FusedAmpStep, takes_grads
from fastpar.mesh.groups import ParallelMesh
from fastpar.ops.unscale_norm import clip_coefficient, norm_and_inf, unscale_and_norm


class OptimizerFront:
    """What every fastpar optimizer wrapper shows a training loop: the wrapped optimizer's
    ``param_groups``, the count of skipped steps and loss scaling. The class using it sets
    ``optimizer``, ``scaler`` (or None) and ``_skipped`` (a 0-dim int64 device tensor), and
    defines ``step() -> (skipped, grad_norm)`` and ``zero_grad``: ``fastpar.amp.AmpOptimizer``."""

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def skipped_steps(self) -> torch.Tensor:
        """How many steps were skipped for inf/NaN gradients (a device tensor)."""
        return self._skipped

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (``loss`` unchanged without a scaler): call backward on this."""
        return loss if self.scaler is None else loss * self.scaler.scale.to(loss.device)


# (gradients, fp32 outputs or None for in place, whether they count in the norm)
Pass = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor] | None, bool]


def inv_scale_of(scaler, device) -> torch.Tensor:
    """``1 / scale`` of ``scaler`` as a 0-dim fp32 tensor on ``device`` (1 without a scaler),
    taken now: a later ``scaler.update`` does not change it."""
    if scaler is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return scaler.inv_scale.to(device=device, dtype=torch.float32)


def unscale_and_agree(
    passes: Sequence[Pass], scaler, device, *, mesh: ParallelMesh | None = None, group=None
):
    """Unscale every gradient (by 1/scale; in place or into fp32 outputs), raise one flag on
    any inf/NaN and sum the squares of the counted ones; then one all-reduce over every rank
    taking part. Returns (found_inf 0-dim fp32 in {0, 1}, global norm 0-dim fp32)."""
    inv = inv_scale_of(scaler, device)
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    sumsq = torch.zeros((), dtype=torch.float32, device=device)
    for grads, outs, counted in passes:
        if grads:
            _, ss, _ = unscale_and_norm(
                list(grads), inv, out=outs, found_inf=found_inf, norm=counted
            )
            if counted:
                sumsq = sumsq + ss
    return all_reduce_norm_and_inf(sumsq, found_inf, mesh=mesh, group=group)


# (gradients, whether they count in the norm)
ReadPass = tuple[Sequence[torch.Tensor], bool]


def norm_and_agree(
    passes: Sequence[ReadPass],
    inv_scale: torch.Tensor,
    device,
    *,
    mesh: ParallelMesh | None = None,
    group=None,
):
    """``unscale_and_agree`` without writing anything: the flag and the sum of squares of the
    counted gradients' ``fp32(g) · inv_scale`` (``fastpar.ops.unscale_norm.norm_and_inf``),
    then the same one all-reduce. Returns (found_inf in {0, 1}, global norm), 0-dim fp32;
    bit for bit those of ``unscale_and_agree`` with fp32 outputs. The optimizer must then be
    given ``inv_scale`` (``guarded_step(..., inv_scale=)``)."""
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    sumsq = torch.zeros((), dtype=torch.float32, device=device)
    for grads, counted in passes:
        if grads:
            _, ss, _ = norm_and_inf(list(grads), inv_scale, found_inf=found_inf, norm=counted)
            if counted:
                sumsq = sumsq + ss
    return all_reduce_norm_and_inf(sumsq, found_inf, mesh=mesh, group=group)


@contextlib.contextmanager
def amp_attributes(optimizer: torch.optim.Optimizer, **values: Any) -> Iterator[None]:
    """Set ``values`` as attributes of ``optimizer`` for the block (torch's protocol for its
    fused optimizers, as ``torch.amp.GradScaler`` speaks it), then put back what was there
    before: nothing is left on the optimizer, even when its step raises."""
    own = vars(optimizer)
    missing = object()
    saved = {name: own.get(name, missing) for name in values}
    own.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                own.pop(name, None)
            else:
                own[name] = value


def guarded_step(
    optimizer: torch.optim.Optimizer,
    grads: Sequence[torch.Tensor],
    found: torch.Tensor,
    norm: torch.Tensor,
    *,
    scaler=None,
    max_grad_norm: float | None = None,
    skipped_counter: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
    grads_for: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Update the scaler, clip ``grads`` to ``max_grad_norm`` (folded into the optimizer's pass
    when it is a ``FusedAmpStep``, such as FusedAdamW), and step ``optimizer`` unless ``found``:
    on the device for optimizers that take a ``found_inf``, else after one host sync. Leaves no
    attribute on ``optimizer``. Returns ``skipped`` (0-dim bool tensor).

    Folded form (after ``norm_and_agree``): ``inv_scale`` (the one the pass used) is handed to
    a ``FusedAmpStep`` optimizer, and ``grads_for`` (parameter -> raw gradient, for a
    ``FoldedAmpStep``) replaces those parameters' ``.grad``."""
    fused = isinstance(optimizer, FusedAmpStep)
    if (inv_scale is not None and not fused) or (
        grads_for is not None and not takes_grads(optimizer)
    ):
        raise TypeError(
            f"{type(optimizer).__name__} does not unscale in its own step "
            "(fastpar.amp.FusedAmpStep / FoldedAmpStep): unscale the gradients with "
            "unscale_and_agree and call guarded_step without inv_scale / grads_for"
        )
    if scaler is not None:
        scaler.update(found > 0)
    skipped = found > 0
    if skipped_counter is not None:
        skipped_counter += skipped.long()
    coef = None
    if max_grad_norm is not None:
        coef = clip_coefficient(norm, max_grad_norm)
        if not fused and grads:
            torch._foreach_mul_(list(grads), coef)
    if fused:
        extra = {} if grads_for is None else {"grads": grads_for}
        optimizer.amp_step(found_inf=found, inv_scale=inv_scale, clip_coef=coef, **extra)
    elif getattr(optimizer, "_step_supports_amp_scaling", False):
        # torch's protocol: it reads a device found_inf (torch's fused ones, FusedAdamW)
        with amp_attributes(optimizer, grad_scale=None, found_inf=found):
            optimizer.step()
    elif not bool(skipped):
        optimizer.step()
    return skipped
