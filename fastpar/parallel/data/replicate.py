"""The data-parallel family's two wrappers, one constructor shape:

    model = Replicate(model, optimizer_factory, mesh=mesh, ...)           # stage 0 (DDP)
    model = Shard(model, optimizer_factory, stage=1 | 2 | 3, mesh=mesh, ...)   # ZeRO

Their arguments and the ``DataParallel`` protocol they provide: docs/layouts.md ("The
data-parallel family")."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fastpar.mesh.groups import ParallelMesh
from fastpar.parallel.data.family import FlatDataParallel, MakeOptimizer
from fastpar.parallel.data.units import Units

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def parameter_groups(
    module: nn.Module, factory: OptimizerFactory | None, param_groups: list[dict] | None
) -> tuple[list[list[nn.Parameter]], MakeOptimizer | None]:
    """(the module's parameters per optimizer group, how to build the optimizer on the masters
    of each group) for ``factory`` and ``param_groups``."""
    if param_groups is None:
        groups, extra = [list(dict.fromkeys(module.parameters()))], [{}]
    else:
        groups = [list(g["params"]) for g in param_groups]
        extra = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        listed = {id(p) for g in groups for p in g}
        missing = [p for p in module.parameters() if p.requires_grad and id(p) not in listed]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) are in no entry of param_groups; "
                "list every parameter of the model once"
            )
    if factory is None:
        return groups, None
    if param_groups is None:
        return groups, lambda masters: factory(masters[0])
    return groups, lambda masters: factory(
        [{"params": ms, **e} for ms, e in zip(masters, extra, strict=True)]
    )


class Replicate(FlatDataParallel, nn.Module):
    """Stage 0: every rank holds the whole model, its gradients, masters and optimizer state;
    gradients are all-reduced in place (``.grad`` holds the DP average when backward returns).
    Arguments: docs/layouts.md."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory | None = None,
        *,
        mesh: ParallelMesh | None = None,
        group: dist.ProcessGroup | None = None,
        param_groups: list[dict] | None = None,
        scaler=None,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        find_unused_parameters: bool = False,
        check_gradients: bool = True,
        bucket_size_mb: float = 25.0,
        broadcast_parameters: bool = True,
    ) -> None:
        nn.Module.__init__(self)
        self.module = module
        groups, make = parameter_groups(module, optimizer_factory, param_groups)
        self._setup(
            module,
            groups,
            make,
            stage=0,
            mesh=mesh,
            group=group,
            bucket_size_mb=bucket_size_mb,
            reduce_dtype=reduce_dtype,
            scaler=scaler,
            max_grad_norm=max_grad_norm,
            find_unused_parameters=find_unused_parameters,
            check_gradients=check_gradients,
            broadcast_parameters=broadcast_parameters,
        )

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs) -> dict:
        """With an optimizer: the training state (``FlatDataParallel.state_dict``); for
        gradient synchronisation only, the module's (nn.Module's)."""
        if self.optimizer is None:
            return nn.Module.state_dict(self, *args, **kwargs)
        return FlatDataParallel.state_dict(self)

    def load_state_dict(self, state: dict, strict: bool = True, **kwargs):  # type: ignore[override]
        if self.optimizer is None:
            return nn.Module.load_state_dict(self, state, strict=strict, **kwargs)
        return FlatDataParallel.load_state_dict(self, state)


class Shard(FlatDataParallel, nn.Module):
    """ZeRO stage 1 (optimizer state and masters sharded), 2 (gradients too) or 3 (parameters too,
    gathered per unit around its forward and backward). Arguments: docs/layouts.md. Between steps at
    stage 3 the parameters are empty tensors: read them inside ``summon_full_params()``."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory,
        *,
        stage: int = 3,
        mesh: ParallelMesh | None = None,
        group: dist.ProcessGroup | None = None,
        param_groups: list[dict] | None = None,
        scaler=None,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        find_unused_parameters: bool = False,
        check_gradients: bool = True,
        bucket_size_mb: float | None = None,
        broadcast_parameters: bool = True,
        wrap: Sequence[type] | None = None,
        min_params: int | None = None,
        persist_below: int = 0,
        prefetch: bool = True,
    ) -> None:
        nn.Module.__init__(self)
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3 (stage 0 is Replicate), got {stage!r}")
        stage3 = dict(wrap=wrap, min_params=min_params, persist_below=persist_below or None)
        if stage != 3 and any(v is not None for v in stage3.values()):
            given = sorted(k for k, v in stage3.items() if v is not None)
            raise ValueError(f"{given} are ZeRO-3's unit policy: pass them with stage=3 only")
        if stage == 3 and bucket_size_mb is not None:
            raise ValueError("bucket_size_mb is for stages 1-2: ZeRO-3 buckets by unit (wrap=)")
        self.module = module
        groups, make = parameter_groups(module, optimizer_factory, param_groups)
        units = Units(self, module, wrap, min_params, prefetch) if stage == 3 else None
        self._setup(
            module,
            groups,
            make,
            stage=stage,
            mesh=mesh,
            group=group,
            bucket_size_mb=25.0 if bucket_size_mb is None else bucket_size_mb,
            reduce_dtype=reduce_dtype,
            scaler=scaler,
            max_grad_norm=max_grad_norm,
            find_unused_parameters=find_unused_parameters,
            check_gradients=check_gradients,
            broadcast_parameters=broadcast_parameters,
            units=units,
            persist_below=persist_below,
        )

    def forward(self, *args, **kwargs):
        """Run the wrapped module (stage 3: the root unit is gathered around it)."""
        if self._units is None:
            return self.module(*args, **kwargs)
        self._units.before_forward(0)
        out = self.module(*args, **kwargs)
        self._units.after_forward(0, out)
        return out

    # -- ZeRO-3's counters ---------------------------------------------------------------------
    @property
    def units(self):
        return [] if self._units is None else self._units.units

    @property
    def peak_gathered_bytes(self) -> int:
        """Largest total of full parameter buffers alive at once (stage 3)."""
        return 0 if self._units is None else self._units.peak_gathered_bytes

    @property
    def _gathered_bytes(self) -> int:
        return 0 if self._units is None else self._units.gathered_bytes

    def flat_numels(self, sharded: bool = True) -> list[int]:
        """Unpadded element counts of the (sharded or replicated) flats, for
        ``fastpar.zero.estimate_memory(..., bucket_numels=...)``."""
        return [f.bucket.numel for f in self.flats if f.sharded == sharded]

    def padded_numel(self, sharded: bool = True) -> int:
        """Ψ_padded: elements of the (sharded or replicated) flats, padding included."""
        return sum(f.padded for f in self.flats if f.sharded == sharded)
