"""Tensor-parallel linear layers: ``ColumnParallelLinear`` and ``RowParallelLinear``.

Both initialise the full master weight exactly as ``nn.Linear`` would (same random stream) and
keep the local slice, so a model built from them equals the ``nn.Linear`` model drawn under
the same seed, bit for bit, at any tensor-parallel size.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar import debug
from fastpar.comm import (
    all_gather_reduce_scatter,
    copy_to_region,
    gather_from_region,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_all_gather,
    scatter_to_region,
)
from fastpar.comm.checks import check_same
from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_replicated, mark_sharded
from fastpar.ops.fp8_linear import Fp8Use, column_splits, fp8_linear, row_splits


def _master_linear(in_features, out_features, bias, device, dtype) -> nn.Linear:
    # Draws the full weight and bias from the random stream exactly as nn.Linear does.
    return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


def _fused_slices(weight: torch.Tensor, fused: int, rank: int, world: int) -> torch.Tensor:
    """Rows of ``weight`` [fused * n, ...] that this rank keeps: its 1/world of each of the
    ``fused`` blocks (so a fused q|k|v projection splits by heads, not by block)."""
    blocks = weight.chunk(fused, dim=0)
    return torch.cat([b.chunk(world, dim=0)[rank] for b in blocks], dim=0)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer whose weight is stored [in, out]."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
        and module.weight.shape[1] == module.nf
    )


_SAME_BATCH = (
    "every rank of a tensor-parallel group must pass the same shapes (the same micro-batch)"
)


class _FromDense:
    @classmethod
    def from_dense(cls, linear: nn.Module, **kwargs):
        """Shard an existing ``nn.Linear`` or Hugging Face ``Conv1D`` (every rank must pass the
        same weights). A Conv1D keeps its [in, out] weight layout (``transposed=True``), so
        parameter names and shapes stay those of the Hugging Face checkpoint."""
        if is_conv1d(linear):
            in_f, out_f = linear.weight.shape
            bias = None if linear.bias is None else linear.bias.detach()
            master = SimpleNamespace(weight=linear.weight.detach().t(), bias=bias)
            return cls(in_f, out_f, bias is not None, _master=master, _transposed=True, **kwargs)
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"{cls.__name__}.from_dense needs an nn.Linear or a Hugging Face Conv1D, found "
                f"{type(linear).__name__}"
            )
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            _master=linear,
            **kwargs,
        )

    def _check_input(self, x: torch.Tensor) -> None:
        """Debug checks (``fastpar.debug``): every rank of the group passes the same shape."""
        if debug.enabled():
            name = f"{type(self).__name__}({self.in_features}, {self.out_features})"
            fields = {"input shape": tuple(x.shape), "input dtype": x.dtype}
            check_same(name, fields, self.group, x.device, _SAME_BATCH)

    fp8: Fp8Use | None = None
    """The GEMMs in fp8 with this recipe (``fastpar.nn.fp8_apply.use_fp8``); None: in the
    parameters' precision."""

    def _weight(self) -> torch.Tensor:
        """The weight as ``F.linear`` wants it, [out, in] (a view for a Conv1D layout)."""
        return self.weight.t() if self.transposed else self.weight

    def _linear(self, x: torch.Tensor, bias, splits) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, in fp8 when ``self.fp8`` says so (``splits``: how
        this layer's operands are split over its group, ``fastpar.ops.fp8_linear``)."""
        if self.fp8 is None:
            return F.linear(x, self._weight(), bias)
        return fp8_linear(x, self._weight(), self.fp8, splits(self.group), bias)


class ColumnParallelLinear(_FromDense, nn.Module):
    """y = x Aᵀ + b with A split by rows (output features) over the TP group.

    Shapes: input [..., in_features] (or [s/tp, ..., in_features] with sequence_parallel);
    output [..., out_features/tp], or [..., out_features] with ``gather_output``.
    Communication over ``group``: backward all-reduce of the input gradient; with
    ``sequence_parallel`` an all-gather of the input along ``sequence_dim`` instead (and a
    reduce-scatter backward); with ``gather_output`` an all-gather of the output.

    ``fused=k`` treats the output as k stacked blocks (e.g. q|k|v) and gives each rank its share
    of every block. ``pad_output=True`` allows out_features not divisible by the group size:
    the local size is rounded up and the padded rows are zero (and trimmed by gather_output).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        skip_bias_add: bool = False,
        fused: int = 1,
        pad_output: bool = False,
        group: dist.ProcessGroup | None = None,
        mesh: ParallelMesh | DeviceMesh | None = None,
        device=None,
        dtype=None,
        _master: nn.Linear | None = None,
        _transposed: bool = False,
    ) -> None:
        super().__init__()
        self.group = as_group(mesh, "tp", group)
        world, rank = group_size(self.group), group_rank(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.transposed = _transposed
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.sequence_dim, self.skip_bias_add, self.fused = sequence_dim, skip_bias_add, fused
        if out_features % fused:
            raise ValueError(f"out_features {out_features} is not divisible by fused={fused}")
        block = out_features // fused
        if block % world and not (pad_output and fused == 1):
            raise ValueError(
                f"ColumnParallelLinear: out_features {out_features}"
                + (f" (blocks of {block})" if fused > 1 else "")
                + f" is not divisible by the tensor-parallel size {world}; use a size that "
                f"divides it, or pad_output=True (fused=1 only)"
            )
        if fused > 1 and gather_output:
            raise ValueError("gather_output=True is not supported with fused > 1")
        self.out_per_rank = math.ceil(out_features / world)
        master = _master or _master_linear(in_features, out_features, bias, device, dtype)

        def rows(t: torch.Tensor) -> torch.Tensor:  # this rank's share of each fused block
            if fused > 1:
                return _fused_slices(t, fused, rank, world)
            return _pad_rows(t, self.out_per_rank * world).chunk(world, dim=0)[rank]

        with torch.no_grad():
            w = rows(master.weight)
            b = None if master.bias is None else rows(master.bias)
        self.weight = nn.Parameter(w.t().contiguous() if self.transposed else w.clone())
        mark_sharded(self.weight, 1 if self.transposed else 0, self.group, out_features, fused)
        if b is not None:
            self.bias = nn.Parameter(b.clone())
            mark_sharded(self.bias, 0, self.group, out_features, fused)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, adapter=None):
        """``adapter(x, y)``: what becomes of this rank's output columns ``y`` (of the input
        ``x`` as the GEMM read it, inside the TP region) before any gather; a LoRA adapter's
        sum (``fastpar.nn.lora``)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear expects input [..., {self.in_features}], got {tuple(x.shape)}"
            )
        self._check_input(x)
        if self.sequence_parallel:
            x = all_gather_reduce_scatter(x, self.group, self.sequence_dim)
        else:
            x = copy_to_region(x, self.group)
        bias = None if self.skip_bias_add else self.bias
        y = self._linear(x, bias, column_splits)
        if adapter is not None:
            y = adapter(x, y)
        if self.gather_output:
            y = gather_from_region(y, self.group, dim=-1)
            if y.shape[-1] != self.out_features:
                y = y[..., : self.out_features]
        if self.skip_bias_add:
            return y, self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_per_rank} per rank), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_FromDense, nn.Module):
    """y = x Aᵀ + b with A split by columns (input features) over the TP group.

    Shapes: input [..., in_features/tp] (``input_is_parallel=True``, e.g. the output of a
    ColumnParallelLinear) or [..., in_features]; output [..., out_features] (or
    [s/tp, ..., out_features] with sequence_parallel). Communication over ``group``: forward
    all-reduce of the partial products (reduce-scatter along ``sequence_dim`` with
    sequence_parallel). The bias is added once, after the reduction; with sequence_parallel its
    gradient is all-reduced over the group so every rank holds the full gradient.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        skip_bias_add: bool = False,
        group: dist.ProcessGroup | None = None,
        mesh: ParallelMesh | DeviceMesh | None = None,
        device=None,
        dtype=None,
        _master: nn.Linear | None = None,
        _transposed: bool = False,
    ) -> None:
        super().__init__()
        self.group = as_group(mesh, "tp", group)
        world, rank = group_size(self.group), group_rank(self.group)
        self.transposed = _transposed
        if in_features % world:
            raise ValueError(
                f"RowParallelLinear: in_features {in_features} is not divisible by the "
                f"tensor-parallel size {world}; use a size that divides it"
            )
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = in_features // world
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.sequence_dim, self.skip_bias_add = sequence_dim, skip_bias_add
        master = _master or _master_linear(in_features, out_features, bias, device, dtype)
        with torch.no_grad():
            w = master.weight.chunk(world, dim=1)[rank]
        self.weight = nn.Parameter(w.t().contiguous() if self.transposed else w.clone())
        mark_sharded(self.weight, 0 if self.transposed else 1, self.group, in_features)
        if master.bias is not None:
            self.bias = nn.Parameter(master.bias.detach().clone())
            mark_replicated(self.bias, self.group)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, adapter=None):
        """``adapter(x, y)``: what becomes of this rank's partial product ``y`` (of its input
        columns ``x``) before the reduction over TP; a LoRA adapter's sum (``fastpar.nn.lora``)."""
        expected = self.in_per_rank if self.input_is_parallel else self.in_features
        if x.shape[-1] != expected:
            raise ValueError(
                f"RowParallelLinear expects input [..., {expected}] "
                f"(input_is_parallel={self.input_is_parallel}), got {tuple(x.shape)}"
            )
        self._check_input(x)
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group, dim=-1)
        y = self._linear(x, None, row_splits)
        if adapter is not None:
            y = adapter(x, y)
        if self.sequence_parallel:
            y = reduce_scatter_all_gather(y, self.group, self.sequence_dim)
        else:
            y = reduce_from_region(y, self.group)
        if self.bias is None:
            return (y, None) if self.skip_bias_add else y
        # Under sequence parallelism each rank adds the bias to a different chunk of tokens,
        # so its gradient is a partial sum: copy_to_region all-reduces it in backward.
        bias = copy_to_region(self.bias, self.group) if self.sequence_parallel else self.bias
        if self.skip_bias_add:
            return y, bias
        return y + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_per_rank} per rank), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)
