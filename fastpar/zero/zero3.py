"""``Zero3``: ZeRO stage 3 — parameters, gradients and optimizer state sharded over DP —
``fastpar.parallel.Shard(stage=3)`` under its historical signature. Between steps the parameters
are empty: read them inside ``summon_full_params()``. Layout, units and counters:
docs/layouts.md ("The data-parallel family")."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fastpar.amp.scaler import ConstantLossScaler, DynamicLossScaler
from fastpar.mesh.groups import ParallelMesh
from fastpar.parallel.data.flat import FlatShard
from fastpar.parallel.data.replicate import Shard


class Zero3(Shard):
    """ZeRO-3 around ``module``: ``Shard(module, optimizer_factory, stage=3, ...)``; the
    arguments: docs/layouts.md ("The data-parallel family")."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: Callable[[list], torch.optim.Optimizer],
        *,
        mesh: ParallelMesh | None = None,
        group: dist.ProcessGroup | None = None,
        wrap: Sequence[type] | None = None,
        min_params: int | None = None,
        persist_below: int = 0,
        param_groups: list[dict] | None = None,
        scaler: DynamicLossScaler | ConstantLossScaler | None = None,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        prefetch: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__(
            module,
            optimizer_factory,
            stage=3,
            mesh=mesh,
            group=group,
            wrap=wrap,
            min_params=min_params,
            persist_below=persist_below,
            param_groups=param_groups,
            scaler=scaler,
            max_grad_norm=max_grad_norm,
            reduce_dtype=reduce_dtype,
            prefetch=prefetch,
            find_unused_parameters=find_unused_parameters,
        )

    @property
    def _flats(self) -> list[FlatShard]:
        return self.flats
