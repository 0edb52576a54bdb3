"""``DistributedDataParallel``: bucketed gradient all-reduce over the data-parallel group,
overlapped with backward — ``Replicate`` without an optimizer, under its historical signature.

    model = DistributedDataParallel(model, mesh=mesh)      # dp group from the mesh
    loss = model(x).loss; loss.backward()                  # buckets all-reduce as backward runs
    optimizer.step(); model.zero_grad()

Each parameter's ``.grad`` is a view into its bucket's flat buffer, so autograd accumulates
straight into the buffer; when a bucket's last gradient arrives its all-reduce starts
asynchronously (gradients divided by the DP size first, then summed: gloo has no AVG), and
backward's end waits for all of them, so ``.grad`` holds the DP average when ``backward()``
returns. ``no_sync()`` accumulates without communicating (gradient accumulation). To let the
wrapper own the optimizer step too (fp32 masters, loss scaling, clipping, the norm), use
``Replicate(model, optimizer_factory, ...)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fastpar.parallel.replicate import Replicate


class DistributedDataParallel(Replicate):
    """Wrap ``module`` for data parallelism over ``mesh.dp_group`` (or ``group``; None = the
    default group).

    ``bucket_size_mb``: bucket capacity. ``reduce_dtype``: reduce low-precision gradients in
    this dtype (e.g. torch.float32 for bf16 gradients; default None: their own).
    ``find_unused_parameters``: treat parameters that got no gradient in a backward as
    zero-gradient instead of raising. Parameters and buffers are broadcast from the group's
    first rank when wrapped. ``comm_bytes`` counts the bytes this rank sent (ring all-reduce:
    2(N-1)/N of each bucket).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        mesh=None,
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
