"""Loss scalers for fp16 training: dynamic (Megatron-Core semantics, with hysteresis) and constant.

bf16 has fp32's exponent range and needs no scaler. Every scale stays a finite fp32 number:
a growth that would overflow is refused (torch.amp.GradScaler's rule), so an infinite scale,
which no back-off could bring back, never arises.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch

Policy = Literal["raise", "warn", "ignore"]


class LossScaleError(RuntimeError):
    """Raised when steps keep overflowing at the minimum loss scale (policy "raise")."""


FP32_MAX = torch.finfo(torch.float32).max
LARGEST_POWER_OF_TWO = 2.0**127  # what an infinite scale from a checkpoint is brought back to


def _check_scale(name: str, value: float) -> None:
    """``value`` must be positive and finite once stored as fp32."""
    if not 0 < value <= FP32_MAX:  # NaN fails too
        raise ValueError(
            f"{name} must be positive and finite in fp32 (at most {FP32_MAX:.4e}), got {value}"
        )


def _loaded_scale(value) -> torch.Tensor:
    """A checkpoint's scale as fp32; +inf (saved by a scaler that could overflow) comes back as
    2^127 with a warning, a NaN or non-positive scale is an error."""
    scale = torch.as_tensor(value, dtype=torch.float32).reshape(())
    if torch.isposinf(scale):
        warnings.warn(
            f"the loaded loss scale is inf; using {LARGEST_POWER_OF_TWO:.4e} (2^127) instead, "
            "from which it backs off at the next overflow",
            RuntimeWarning,
            stacklevel=3,
        )
        return torch.tensor(LARGEST_POWER_OF_TWO)
    _check_scale("the loaded loss scale", float(scale))
    return scale


def _as_flag(found_inf: bool | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(found_inf, torch.Tensor):
        if found_inf.numel() != 1:
            raise ValueError(
                f"found_inf must be a bool or a 0-dim tensor, got shape {tuple(found_inf.shape)}"
            )
        return found_inf.reshape(()).to(device=device, dtype=torch.bool)
    return torch.tensor(bool(found_inf), device=device)


class _Scaled:
    """What every scaler exposes of its 0-dim fp32 ``_scale``."""

    _scale: torch.Tensor

    @property
    def scale(self) -> torch.Tensor:
        """The current scale: a 0-dim fp32 tensor on the scaler's device."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.reciprocal()


class ConstantLossScaler(_Scaled):
    """A fixed loss scale; ``update`` does nothing."""

    def __init__(self, scale: float = 1.0, *, device: torch.device | str | None = None) -> None:
        _check_scale("scale", float(scale))
        self._scale = torch.tensor(float(scale), dtype=torch.float32, device=device)

    def update(self, found_inf: bool | torch.Tensor) -> None:
        _as_flag(found_inf, self._scale.device)

    def state_dict(self) -> dict:
        return {"scale": self._scale.clone()}

    def load_state_dict(self, state: dict) -> None:
        self._scale.copy_(_loaded_scale(state["scale"]))


class DynamicLossScaler(_Scaled):
    """Dynamic loss scaling with hysteresis (Megatron-Core's semantics), its state on ``device``,
    ``update`` without a host sync. ``on_min_scale``: "raise" (LossScaleError), "warn" or "ignore"
    when a step overflows at ``min_scale``. The rule: docs/layouts.md ("Mixed precision")."""

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        *,
        on_min_scale: Policy = "raise",
        device: torch.device | str | None = None,
    ) -> None:
        _check_scale("initial_scale", float(initial_scale))
        _check_scale("min_scale", float(min_scale))
        if initial_scale < min_scale:
            raise ValueError(
                f"need initial_scale >= min_scale > 0, got initial_scale={initial_scale}, "
                f"min_scale={min_scale}"
            )
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}"
            )
        if on_min_scale not in ("raise", "warn", "ignore"):
            raise ValueError(
                f"on_min_scale must be 'raise', 'warn' or 'ignore', got {on_min_scale!r}"
            )
        self.min_scale, self.growth_factor, self.backoff_factor = (
            min_scale,
            growth_factor,
            backoff_factor,
        )
        self.growth_interval, self.hysteresis, self.on_min_scale = (
            growth_interval,
            hysteresis,
            on_min_scale,
        )
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self._scale = torch.tensor(float(initial_scale), **f32)
        self._growth_tracker = torch.tensor(0, **i64)
        self._hysteresis_tracker = torch.tensor(hysteresis, **i64)
        self._warned = False
        self._pending: list = []  # (pinned flag, CUDA event) of recent updates, GPU only

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """Advance the state machine by one step; ``found_inf``: bool or 0-dim tensor."""
        inf = _as_flag(found_inf, self._scale.device)
        hyst_after = torch.where(inf, self._hysteresis_tracker - 1, self._hysteresis_tracker)
        back_off = inf & (hyst_after <= 0)
        stuck = back_off & (self._scale <= self.min_scale)
        backed = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        grown = self._growth_tracker + 1
        grow = (~inf) & (grown >= self.growth_interval)
        larger = self._scale * self.growth_factor
        larger = torch.where(torch.isfinite(larger), larger, self._scale)  # never inf
        self._scale.copy_(torch.where(back_off, backed, torch.where(grow, larger, self._scale)))
        self._growth_tracker.copy_(torch.where(inf | grow, torch.zeros_like(grown), grown))
        self._hysteresis_tracker.copy_(
            torch.where(grow, torch.full_like(hyst_after, self.hysteresis), hyst_after.clamp(min=0))
        )
        if self.on_min_scale == "ignore":
            return
        if stuck.device.type == "cpu":
            self._report(bool(stuck))
            return
        # on a GPU: copy the flag to pinned host memory without waiting, and look at it once the
        # copy has landed (a step or two later) — the policy never stalls the device
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(stuck, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))
        while self._pending and self._pending[0][1].query():
            self._report(bool(self._pending.pop(0)[0]))

    def overflows_to(self, scale: float) -> int:
        """How many overflowing steps in a row, from the present state, bring the scale down to
        ``scale`` or below (0 if it is already there; the hysteresis left is used up first; the
        floor counts as reached). Reads the state on the host (a sync on a GPU: call it once)."""
        now, left = float(self._scale), int(self._hysteresis_tracker)
        target = max(float(scale), self.min_scale)
        if now <= target:
            return 0
        halvings = math.ceil(math.log(now / target) / -math.log(self.backoff_factor) - 1e-9)
        return max(left - 1, 0) + halvings

    def _report(self, stuck: bool) -> None:
        if not stuck:
            return
        msg = (
            f"a step overflowed with the loss scale already at min_scale={self.min_scale}: the "
            "gradients are inf/NaN whatever the scale (diverged training, a bad batch, or too "
            "high a learning rate). Lower the learning rate or min_scale, check the data, or "
            "pass on_min_scale='warn' to keep skipping such steps"
        )
        if self.on_min_scale == "raise":
            raise LossScaleError(msg)
        if not self._warned:
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            self._warned = True

    def state_dict(self) -> dict:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker.clone(),
            "hysteresis_tracker": self._hysteresis_tracker.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._scale.copy_(_loaded_scale(state["scale"]))
        self._growth_tracker.copy_(torch.as_tensor(state["growth_tracker"]))
        self._hysteresis_tracker.copy_(torch.as_tensor(state["hysteresis_tracker"]))
