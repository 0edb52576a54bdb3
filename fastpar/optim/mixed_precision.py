"""``MixedPrecisionOptimizer``: fp32 master weights around any torch optimizer. Its use, the
step, skipping without a host sync and the folded step: docs/layouts.md ("Mixed precision")."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar.amp.norm import counts_on_this_rank
from fastpar.amp.protocols import takes_grads
from fastpar.amp.scaler import ConstantLossScaler, DynamicLossScaler
from fastpar.amp.step import (
    OptimizerFront,
    guarded_step,
    inv_scale_of,
    norm_and_agree,
    unscale_and_agree,
)
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import copy_marks
from fastpar.optim.pieces import load_torch_optimizer_pieces, torch_optimizer_pieces

LOW_PRECISION = (torch.float16, torch.bfloat16)


class MixedPrecisionOptimizer(OptimizerFront):
    """Wraps ``optimizer`` (built on the model's parameters, before any step): fp16/bf16
    parameters get fp32 master copies that the optimizer updates; fp32 parameters are updated
    as they are. ``scaler`` None: no loss scaling (right for bf16 and fp32); ``max_grad_norm``
    None: no clipping (the norm is still returned); ``mesh`` / ``group``: the ranks that agree on
    the norm and on overflow (``dp_replicated=False`` under ZeRO: ``fastpar.amp.norm``);
    ``fold_unscale``: docs/layouts.md ("Mixed precision")."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: DynamicLossScaler | ConstantLossScaler | None = None,
        max_grad_norm: float | None = None,
        mesh: ParallelMesh | None = None,
        group: dist.ProcessGroup | None = None,
        dp_replicated: bool = True,
        fold_unscale: bool | None = None,
    ) -> None:
        if fold_unscale and not takes_grads(optimizer):
            raise ValueError(
                f"fold_unscale=True needs an optimizer that unscales in its own step "
                f"(fastpar.amp.FoldedAmpStep, e.g. fastpar.optim.FusedAdamW), got "
                f"{type(optimizer).__name__}; pass fold_unscale=None or False"
            )
        self.fold_unscale = takes_grads(optimizer) if fold_unscale is None else fold_unscale
        if optimizer.state:
            raise ValueError(
                "wrap the optimizer before its first step: it already holds state for the "
                "model's parameters, which would not follow them to the fp32 masters"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        self.optimizer, self.scaler, self.max_grad_norm = optimizer, scaler, max_grad_norm
        self.mesh, self.group, self.dp_replicated = mesh, group, dp_replicated
        self.model_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        for pg in optimizer.param_groups:
            new = []
            for p in pg["params"]:
                if p.dtype in LOW_PRECISION:
                    m = torch.nn.Parameter(
                        p.detach().float().clone(), requires_grad=p.requires_grad
                    )
                    copy_marks(p, m)  # where it lives (Muon gathers a TP shard's matrix)
                elif p.dtype == torch.float32:
                    m = p
                else:
                    raise TypeError(f"parameter of dtype {p.dtype}: expected fp32, fp16 or bf16")
                self.model_params.append(p)
                self.masters.append(m)
                new.append(m)
            pg["params"] = new
        self._counts = [
            counts_on_this_rank(p, mesh=mesh, group=group, dp_replicated=dp_replicated)
            for p in self.model_params
        ]
        device = self.model_params[0].device if self.model_params else torch.device("cpu")
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in zip(self.model_params, self.masters, strict=True):
            if set_to_none:
                p.grad = None
                m.grad = None
            else:
                for t in {id(p): p, id(m): m}.values():
                    if t.grad is not None:
                        t.grad.zero_()

    def _main_grads(self):
        """Group (model grad, fp32 main grad) pairs into counted / uncounted lists."""
        lists = {True: ([], []), False: ([], [])}
        for p, m, counted in zip(self.model_params, self.masters, self._counts, strict=True):
            if p.grad is None:
                m.grad = None
                continue
            if m is not p and (m.grad is None or m.grad.shape != m.shape):
                m.grad = torch.empty_like(m)
            src, dst = lists[counted]
            src.append(p.grad)
            dst.append(m.grad)
        return lists

    @torch.no_grad()
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One step. Returns (skipped: 0-dim bool tensor, grad_norm: 0-dim fp32 tensor); the norm
        is that of the unscaled gradients before clipping, the same on every rank."""
        if self.fold_unscale:
            skipped, norm = self._folded_step()
        else:
            skipped, norm = self._unscaling_step()
        for p, m in zip(self.model_params, self.masters, strict=True):
            if m is not p:
                p.copy_(m)
        return skipped, norm

    def _folded_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only pass, then the optimizer unscales and clips the raw gradients itself."""
        device = self._skipped.device
        inv = inv_scale_of(self.scaler, device)  # before the scaler's update
        # (counted, fp32) -> grads; passes in the unscaling step's order, so the sums of
        # squares are added up alike (bit-identical norms)
        lists: dict[tuple[bool, bool], list[torch.Tensor]] = {}
        raw: dict[torch.Tensor, torch.Tensor] = {}
        for p, m, counted in zip(self.model_params, self.masters, self._counts, strict=True):
            if m is not p:
                m.grad = None  # no fp32 main gradient: the optimizer reads p.grad
                if p.grad is not None:
                    raw[m] = p.grad
            if p.grad is not None:
                lists.setdefault((counted, m is p), []).append(p.grad)
        passes = [(lists.get((c, f), []), c) for c in (True, False) for f in (True, False)]
        found, norm = norm_and_agree(passes, inv, device, mesh=self.mesh, group=self.group)
        skipped = guarded_step(
            self.optimizer,
            [],
            found,
            norm,
            scaler=self.scaler,
            max_grad_norm=self.max_grad_norm,
            skipped_counter=self._skipped,
            inv_scale=None if self.scaler is None else inv,
            grads_for=raw,
        )
        return skipped, norm

    def _unscaling_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale into fp32 main gradients (fp32 ones in place), then any optimizer steps."""
        passes = []
        for counted, (src, dst) in self._main_grads().items():
            # fp32 params: unscale in place (dst is src); low precision: into the fp32 main grad
            same = [i for i, (s, d) in enumerate(zip(src, dst, strict=True)) if s is d]
            other = [i for i in range(len(src)) if src[i] is not dst[i]]
            passes.append(([src[i] for i in same], None, counted))
            passes.append(([src[i] for i in other], [dst[i] for i in other], counted))
        found, norm = unscale_and_agree(
            passes, self.scaler, self._skipped.device, mesh=self.mesh, group=self.group
        )
        skipped = guarded_step(
            self.optimizer,
            [m.grad for m in self.masters if m.grad is not None],
            found,
            norm,
            scaler=self.scaler,
            max_grad_norm=self.max_grad_norm,
            skipped_counter=self._skipped,
        )
        return skipped, norm

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [m.detach().clone() for m in self.masters],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "skipped_steps": self._skipped.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["masters"]) != len(self.masters):
            raise ValueError(
                f"state has {len(state['masters'])} master tensors, this optimizer {len(self.masters)}"
            )
        with torch.no_grad():
            for p, m, saved in zip(self.model_params, self.masters, state["masters"], strict=True):
                if saved.shape != m.shape:
                    raise ValueError(f"master shape {tuple(saved.shape)} != {tuple(m.shape)}")
                m.copy_(saved)
                if m is not p:
                    p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._skipped.copy_(state["skipped_steps"])

    # -- checkpoint protocol (fastpar.optim.pieces) -----------------------------------------
    def checkpoint_pieces(self) -> list:
        """(model param, key, values, start, stop) for every parameter: "param" (the fp32
        master), the wrapped optimizer's per-element state and "step"; whole local tensors."""
        model_of = {id(m): p for p, m in zip(self.model_params, self.masters, strict=True)}
        return torch_optimizer_pieces(self.optimizer, model_of)

    def load_checkpoint_pieces(self, lookup) -> None:
        """Fill the masters and the wrapped optimizer's state from ``lookup(param, key)``
        (whole local tensors), then copy the masters into the model's parameters."""
        model_of = {id(m): p for p, m in zip(self.model_params, self.masters, strict=True)}
        load_torch_optimizer_pieces(self.optimizer, lookup, model_of)
        with torch.no_grad():
            for p, m in zip(self.model_params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)
