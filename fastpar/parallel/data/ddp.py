"""``DistributedDataParallel``: bucketed gradient all-reduce over the data-parallel group,
overlapped with backward — ``Replicate`` without an optimizer, under its historical signature.

    model = DistributedDataParallel(model, mesh=mesh)      # dp group from the mesh
    model(x).loss.backward()                               # .grad holds the DP average"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fastpar.mesh.groups import ParallelMesh
from fastpar.parallel.data.replicate import Replicate


class DistributedDataParallel(Replicate):
    """Wrap ``module`` for data parallelism over ``mesh.dp_group`` (or ``group``; None = the
    default group): ``Replicate``'s arguments (docs/layouts.md, "The data-parallel family")
    but ``reduce_dtype``, default None here (the gradients' own dtype). Parameters and
    buffers are broadcast from the group's first rank when wrapped.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        mesh: ParallelMesh | None = None,
        group: dist.ProcessGroup | None = None,
        bucket_size_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        find_unused_parameters: bool = False,
        broadcast_parameters: bool = True,
    ) -> None:
        super().__init__(
            module,
            None,
            mesh=mesh,
            group=group,
            bucket_size_mb=bucket_size_mb,
            reduce_dtype=reduce_dtype,
            find_unused_parameters=find_unused_parameters,
            broadcast_parameters=broadcast_parameters,
        )
