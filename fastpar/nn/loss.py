"""``VocabParallelCrossEntropy``: the loss module over vocabulary-sharded logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.ops.cross_entropy import vocab_parallel_cross_entropy


class VocabParallelCrossEntropy(nn.Module):
    """``nn.CrossEntropyLoss`` for logits sharded over the vocabulary across the TP group (after
    a ``ColumnParallelLinear`` that does not gather its output): ``forward(logits [..., V_local],
    target [...] int64 global ids)`` is ``vocab_parallel_cross_entropy`` with this module's
    options: the fp32 loss, one ``[N, 4]`` fp32 all-gather over ``group`` (or ``mesh=``'s "tp")
    in forward, none in backward."""

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        z_loss: float = 0.0,
        *,
        vocab_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        mesh: ParallelMesh | DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if z_loss < 0.0:
            raise ValueError(f"z_loss must be >= 0, got {z_loss}")
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.z_loss = z_loss
        self.vocab_size = vocab_size
        self.group = as_group(mesh, "tp", group)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits,
            target,
            group=self.group,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
            z_loss=self.z_loss,
            vocab_size=self.vocab_size,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
            f"reduction={self.reduction!r}, z_loss={self.z_loss}, vocab_size={self.vocab_size}"
        )
