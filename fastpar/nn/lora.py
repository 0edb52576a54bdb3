"""LoRA adapters on fastpar's tensor-parallel linears and on plain ``nn.Linear``:
y = base(x) + B(A(dropout(x))) · alpha / r, the base frozen (docs/lora.md).

The exact tensor-parallel layouts (the factor that touches the base's split dimension is split
like the base; the other one is whole, its gradient all-reduced over the TP group):

* ``ColumnParallelLinear`` (output split): A [r, in] whole on every rank, B [out/tp, r] split by
  rows like the base's weight (its fused blocks and padding too). The adapter reads the input
  the base reads inside the TP region (after its copy-to-region, or its sequence-parallel
  all-gather), so its input gradient joins the base's one all-reduce (reduce-scatter); A's
  gradient is a partial sum over this rank's output columns: A enters through
  ``copy_to_region`` (an all-reduce of r·in values backward). No collective forward.
* ``RowParallelLinear`` (input split): A [r, in/tp] split by columns like the base's weight,
  B [out, r] whole. B(A_local x_local) is this rank's partial product and is added to the
  base's partial product before the base's one all-reduce (reduce-scatter under sequence
  parallelism): B(Σ_ranks h) = Σ_ranks B(h). B's gradient is then a partial sum over ranks:
  B enters through ``copy_to_region`` (an all-reduce of out·r values backward). No collective
  of its own forward, where reducing h = A_local x_local first would all-reduce tokens·r values.

The rank r is never split, so every rank that divides the base's split divides the adapter's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.comm import (
    copy_to_region,
    group_rank,
    group_size,
)
from fastpar.mesh.placement import mark_replicated, mark_sharded
from fastpar.nn.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    _fused_slices,
    _pad_rows,
    is_conv1d,
)

ALIASES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
"""Short target names (``--lora-targets q,k,v,o,gate,up,down``) -> Hugging Face Llama's module
names. A target also matches a module whose own name is the target (fastpar's Llama: ``qkv``,
``o``, ``gate_up``, ``down``; GPT: ``qkv``, ``proj``, ``fc``) or whose dotted name ends with it
(``self_attn.q_proj``)."""


def _init_factors(r: int, in_f: int, out_f: int, device, dtype) -> tuple[torch.Tensor, ...]:
    """A [r, in] kaiming-uniform(a=√5) and B [out, r] zeros, drawn as PEFT draws them (an
    nn.Linear(in, r), an nn.Linear(r, out), then A again): the same seed, the same A."""
    a = torch.empty(r, in_f, device=device, dtype=dtype)
    b = torch.empty(out_f, r, device=device, dtype=dtype)
    for t in (a, b, a):
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    return a, b.zero_()


class LoRALinear(nn.Module):
    """A LoRA adapter around ``base_layer`` (``nn.Linear``, ``ColumnParallelLinear`` or
    ``RowParallelLinear``): output base(x) + B(A(dropout(x))) · alpha / r, the same inputs,
    outputs and communication as the base (see the module docstring for the layouts).

    ``lora_A`` [r, in] (row: [r, in/tp]) and ``lora_B`` [out, r] (column: [out/tp, r]) are
    drawn as PEFT draws them, or copied from the full tensors ``lora_A`` / ``lora_B`` (every
    rank passes the same). They are held in ``dtype`` (default: the base's dtype when it is
    fp32 or fp64, else fp32: a bf16 base trains fp32 adapters, cast at the boundary). The base's
    parameters are frozen (``requires_grad=False``)."""

    def __init__(
        self,
        base_layer: nn.Module,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        *,
        lora_A: torch.Tensor | None = None,
        lora_B: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        name: str = "the layer",
    ) -> None:
        super().__init__()
        kind = layout_kind(base_layer, name)
        in_f, out_f = features(base_layer)
        check_rank(name, r, in_f, out_f)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(
                f"LoRA at {name!r}: dropout {dropout} is outside [0, 1); pick one in it"
            )
        self.base_layer, self.kind, self.r, self.alpha = base_layer, kind, r, alpha
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        for p in base_layer.parameters():
            p.requires_grad_(False)
        w = base_layer.weight
        if dtype is None:
            dtype = w.dtype if w.dtype in (torch.float32, torch.float64) else torch.float32
        a, b = _init_factors(r, in_f, out_f, w.device, dtype)
        with torch.no_grad():
            if lora_A is not None:
                check_factor(name, "lora_A", lora_A, (r, in_f))
                a = lora_A.detach().to(w.device, dtype)
            if lora_B is not None:
                check_factor(name, "lora_B", lora_B, (out_f, r))
                b = lora_B.detach().to(w.device, dtype)
            self.group = base_layer.group if kind != "dense" else None
            world, rank = 1, 0
            if kind != "dense":  # (a group of None is the default group)
                world, rank = group_size(self.group), group_rank(self.group)
            if kind == "column":
                if base_layer.fused > 1:
                    b = _fused_slices(b, base_layer.fused, rank, world)
                else:
                    b = _pad_rows(b, base_layer.out_per_rank * world).chunk(world, 0)[rank]
            elif kind == "row":
                a = a.chunk(world, dim=1)[rank]
        self.lora_A = nn.Parameter(a.clone().contiguous())
        self.lora_B = nn.Parameter(b.clone().contiguous())
        if kind == "column":
            mark_replicated(self.lora_A, self.group)
            mark_sharded(self.lora_B, 0, self.group, out_f, base_layer.fused)
        elif kind == "row":
            mark_sharded(self.lora_A, 1, self.group, in_f)
            mark_replicated(self.lora_B, self.group)

    @property
    def in_features(self) -> int:
        return features(self.base_layer)[0]

    @property
    def out_features(self) -> int:
        return features(self.base_layer)[1]

    @property
    def weight(self) -> torch.Tensor:
        """The base's (frozen) weight, for code that reads ``module.weight``."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def _adapter(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """B(A(dropout(x))) · scaling in the adapters' dtype (PEFT's order of operations)."""
        x = x.to(self.lora_A.dtype)
        return F.linear(F.linear(self.lora_dropout(x), a), b) * self.scaling

    def forward(self, x: torch.Tensor):
        if self.kind == "column":
            return self._column(x)
        if self.kind == "row":
            return self._row(x)
        result = self.base_layer(x)
        return (result + self._adapter(x, self.lora_A, self.lora_B)).to(result.dtype)

    def _column(self, x: torch.Tensor):
        # inside the base's TP region: A's gradient is a sum over the output columns
        def adapter(x, y):
            a = copy_to_region(self.lora_A, self.group)
            return (y + self._adapter(x, a, self.lora_B)).to(y.dtype)

        return self.base_layer(x, adapter=adapter)

    def _row(self, x: torch.Tensor):
        # the adapter's partial product added before the base's reduction over TP
        def adapter(x, y):
            b = copy_to_region(self.lora_B, self.group)  # B's gradient: a sum over ranks
            return (y + self._adapter(x, self.lora_A, b)).to(y.dtype)

        return self.base_layer(x, adapter=adapter)

    def delta_weight(self) -> torch.Tensor:
        """This rank's part of (alpha / r) · B · A, laid out as the base's ``weight`` (a
        Conv1D-layout base: transposed), in fp32 (fp64 for fp64 adapters)."""
        dtype = torch.float64 if self.lora_A.dtype == torch.float64 else torch.float32
        delta = (self.lora_B.detach().to(dtype) @ self.lora_A.detach().to(dtype)) * self.scaling
        conv1d = is_conv1d(self.base_layer) or getattr(self.base_layer, "transposed", False)
        return delta.t() if conv1d else delta

    def merged_weight(self) -> torch.Tensor:
        """This rank's part of W + (alpha / r) · B · A in the base's layout and dtype."""
        w, delta = self.base_layer.weight.detach(), self.delta_weight()
        return (w.to(delta.dtype) + delta).to(w.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, layout={self.kind}"


def layout_kind(module: nn.Module, name: str) -> str:
    """ "column", "row" or "dense" for a module LoRA wraps exactly; ValueError otherwise."""
    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    if type(module) is nn.Linear or is_conv1d(module):
        return "dense"
    if isinstance(module, LoRALinear):
        raise ValueError(f"LoRA at {name!r}: it already has an adapter; apply_lora once")
    raise ValueError(
        f"LoRA at {name!r}: {type(module).__name__} has no exact adapter layout (only "
        f"nn.Linear, Hugging Face's Conv1D, ColumnParallelLinear and RowParallelLinear); leave "
        f"it out of the targets"
    )


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer (a Conv1D's weight is [in, out])."""
    if is_conv1d(module):
        return tuple(module.weight.shape)
    return module.in_features, module.out_features


def check_rank(name: str, r: int, in_f: int, out_f: int) -> None:
    """A rank in [1, min(in, out)]: ValueError naming the module and the fix otherwise."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA at {name!r}: rank {r!r} must be a positive integer")
    if r > min(in_f, out_f):
        raise ValueError(
            f"LoRA at {name!r}: rank {r} is larger than min(in_features {in_f}, "
            f"out_features {out_f}) = {min(in_f, out_f)}; use a rank of at most that"
        )


def check_dropout(name: str, p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"LoRA at {name!r}: dropout {p} is outside [0, 1); pick one in it")


def check_factor(name: str, which: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
    """``t`` has the full shape ``shape`` of the adapter factor: ValueError otherwise."""
    if tuple(t.shape) != shape:
        raise ValueError(
            f"LoRA at {name!r}: {which} has shape {list(t.shape)}, the base needs {list(shape)} "
            f"(rank, in) / (out, rank): the adapter was made for a base of another shape, or "
            f"another rank; load one made for this model"
        )


def _matches(name: str, target: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in (target, ALIASES.get(target)) or name == target or name.endswith("." + target)


def parse_targets(targets: str | Iterable[str]) -> list[str]:
    """``"q,k,v"`` or ``["q", "k", "v"]`` -> the target names, stripped, non-empty."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out = [t.strip() for t in items if t.strip()]
    if not out:
        raise ValueError("LoRA: no target modules given; name some, e.g. q,k,v,o")
    return out


def find_targets(model: nn.Module, targets: str | Iterable[str]) -> list[str]:
    """The names of ``model``'s modules the targets name (in ``named_modules`` order).
    ValueError naming a target that matches no module (with the linear layers there are), or
    ``experts`` (no per-expert adapter yet)."""
    names = [n for n, _ in model.named_modules() if n]
    found: list[str] = []
    for t in parse_targets(targets):
        if t == "experts":
            raise ValueError(
                "LoRA target 'experts': adapters on MoE experts (one per expert) are not "
                "supported yet; leave experts out of the targets"
            )
        hits = [n for n in names if _matches(n, t)]
        if not hits:
            leaves = sorted(
                {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _linear_like(m)}
            )
            raise ValueError(
                f"LoRA target {t!r} matches no module of the model; its linear layers are "
                f"named {leaves}: name one of those"
            )
        found += [n for n in hits if n not in found]
    return [n for n in names if n in found]


def _linear_like(m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) or is_conv1d(m)


def apply_lora(
    model: nn.Module,
    targets: str | Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    *,
    dtype: torch.dtype | None = None,
    freeze: bool = True,
) -> list[str]:
    """Wrap every module of ``model`` the targets name in a ``LoRALinear`` (in place) and
    return their names. With ``freeze`` every other parameter of the model is frozen too
    (PEFT's ``get_peft_model``): only the adapters train. Every check runs before any module
    is wrapped (a refusal leaves the model as it was)."""
    names = find_targets(model, targets)
    for name in names:
        m = model.get_submodule(name)
        layout_kind(m, name)
        check_rank(name, rank, *features(m))
        check_dropout(name, dropout)
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lora = LoRALinear(getattr(owner, leaf), rank, alpha, dropout, dtype=dtype, name=name)
        setattr(owner, leaf, lora)
    return names


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, module) of every LoRA layer of ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield name, m


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter factor of ``model`` (what the optimizer takes)."""
    for name, m in lora_modules(model):
        yield f"{name}.lora_A", m.lora_A
        yield f"{name}.lora_B", m.lora_B


def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight (W + (alpha/r) · B · A, this rank's part) and
    put the base back in the adapter's place: the plain model, its names those before
    ``apply_lora``. Returns the merged modules' names."""
    names = [n for n, _ in lora_modules(model)]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lora = getattr(owner, leaf)
        with torch.no_grad():
            lora.base_layer.weight.copy_(lora.merged_weight())
        setattr(owner, leaf, lora.base_layer)
    return names
