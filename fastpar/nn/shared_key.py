"""``SharedKeyLinear``: a replicated linear layer whose last ``features`` outputs are one key
every local attention head reads (MLA's rope key ``k_pe``): their gradient is all-reduced over
the group backward (docs/hf.md, the ``"shared_key"`` style).

    attn.kv_a_proj_with_mqa = SharedKeyLinear.from_dense(attn.kv_a_proj_with_mqa,
                                                         features=qk_rope_head_dim, group=tp)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar.comm import copy_to_region
from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_replicated


class SharedKeyLinear(nn.Linear):
    """y = x Wᵀ + b, whole on every rank of the TP group (input and output [..., in] /
    [..., out], both replicated). Backward: the gradient of ``y[..., -features:]`` (the key
    shared by every head of this rank) is all-reduced over ``group``; the rest is not."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        features: int | None = None,
        group: dist.ProcessGroup | None = None,
        mesh: ParallelMesh | DeviceMesh | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.group = as_group(mesh, "tp", group)
        self.features = _check_features(
            out_features if features is None else features, out_features
        )
        self._mark()

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        *,
        features: int | None = None,
        group=None,
        mesh: ParallelMesh | DeviceMesh | None = None,
    ):
        """The same layer holding ``linear``'s own parameters (no copy: ties and optimizer
        references stay valid)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"SharedKeyLinear.from_dense needs an nn.Linear, found {type(linear).__name__}"
            )
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.group = as_group(mesh, "tp", group)
        out = linear.out_features
        layer.features = _check_features(out if features is None else features, out)
        layer.train(linear.training)
        layer._mark()
        return layer

    def _mark(self) -> None:
        for p in (self.weight, self.bias):
            if p is not None:
                mark_replicated(p, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        k = self.features
        if k == self.out_features:
            return copy_to_region(y, self.group)
        rest, shared = y.split([self.out_features - k, k], dim=-1)
        return torch.cat([rest, copy_to_region(shared, self.group)], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shared key features={self.features} (last)"


def _check_features(features, out_features: int) -> int:
    if isinstance(features, bool) or not isinstance(features, int):
        raise TypeError(f"SharedKeyLinear: features must be an int, got {features!r}")
    if not 0 < features <= out_features:
        raise ValueError(
            f"SharedKeyLinear: features={features} must be in 1..{out_features} (the number of "
            f"the layer's last output features that every head reads)"
        )
    return features
