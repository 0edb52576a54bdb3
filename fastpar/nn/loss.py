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
    """Cross-entropy of logits sharded over the vocabulary across a tensor-parallel group.

    A drop-in for ``nn.CrossEntropyLoss`` after a ``ColumnParallelLinear`` output layer that
    does not gather its output: ``forward(logits [..., V_local], target [...] int64 global ids)``
    returns the fp32 loss (scalar, or the shape of ``target`` for ``reduction="none"``), equal to
    ``nn.CrossEntropyLoss`` on the full logits plus ``z_loss · logsumexp²`` per row.
    ``vocab_size``: the global vocabulary when the shards carry padding (default: ``V_local·tp``).
    ``group``: the tensor-parallel group (default: the world; or ``mesh=``, a ParallelMesh or a
    torch DeviceMesh with a "tp" dim, as the layers take it); the forward all-gathers ``[N, 4]``
    fp32 statistics over it and the backward communicates nothing. Ranks whose shard widths or
    targets differ raise the same ``ValueError`` on every rank (see ``fastpar.debug`` for the
    checks of shapes, behind ``fastpar.debug_checks``).
    """

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
