"""``ZeroOptimizer``: ZeRO stages 1 and 2 around an existing optimizer — ``fastpar.parallel.Shard``
(stage 1 or 2) under its historical, optimizer-shaped signature; it reduces the gradients
itself (no ``DistributedDataParallel`` around the model). docs/layouts.md ("The data-parallel
family", "Historical signatures")."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar.amp.scaler import ConstantLossScaler, DynamicLossScaler
from fastpar.mesh.groups import ParallelMesh
from fastpar.parallel.data.family import FlatDataParallel


class ZeroOptimizer(FlatDataParallel):
    """ZeRO-1/2 around ``optimizer`` (built on the model's parameters, before any step).
    ``stage``: 1 shards optimizer state and masters; 2 also shards gradients. The other arguments
    are ``Shard``'s (docs/layouts.md, "The data-parallel family")."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int = 1,
        mesh: ParallelMesh | None = None,
        group: dist.ProcessGroup | None = None,
        bucket_size_mb: float = 25.0,
        scaler: DynamicLossScaler | ConstantLossScaler | None = None,
        max_grad_norm: float | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        check_gradients: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (ZeRO-3 is fastpar.zero.Zero3), got {stage!r}")
        if optimizer.state:
            raise ValueError("wrap the optimizer before its first step (it already holds state)")
        self.module = None
        self._setup(
            None,
            [list(g["params"]) for g in optimizer.param_groups],
            lambda masters: _repoint(optimizer, masters),
            stage=stage,
            mesh=mesh,
            group=group,
            bucket_size_mb=bucket_size_mb,
            reduce_dtype=reduce_dtype,
            scaler=scaler,
            max_grad_norm=max_grad_norm,
            check_gradients=check_gradients,
            find_unused_parameters=find_unused_parameters,
        )

    @property
    def shard_grad(self) -> list[torch.Tensor]:
        """The fp32 gradient shards, by bucket."""
        return self.shard_grads


def _repoint(optimizer: torch.optim.Optimizer, masters: list[list]) -> torch.optim.Optimizer:
    """``optimizer`` with each param group's parameters replaced by its masters."""
    for g, ms in zip(optimizer.param_groups, masters, strict=True):
        g["params"] = ms
    return optimizer
