"""Switching a model's linear layers to fp8 (issue 47): ``use_fp8(model, recipe)`` gives every
``ColumnParallelLinear`` / ``RowParallelLinear`` (``parallelize``'d Hugging Face linears
included: they are the same layers) and every ``MoE`` (its routed experts,
``fastpar.moe.fp8_experts``; its router stays) whose fully qualified name the filter selects an
``Fp8Use``; the rest stay in the parameters' precision. By default the embedding, the heads,
routers and norms stay there (``DEFAULT_EXCLUDE``). A shape the recipe cannot scale, or a
device without fp8 GEMMs, is refused with one line naming the module and the fix.
docs/kernels.md, "fp8 linear layers".
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

from fastpar.comm import group_size
from fastpar.moe.layer import MoE
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fastpar.ops import fp8
from fastpar.ops.fp8_linear import Fp8Use
from fastpar.reference.fp8 import MULTIPLE

DEFAULT_EXCLUDE = ("*embed*", "*head", "*router*", "*gate", "*norm*")
"""fnmatch patterns of fully qualified names kept in high precision by default: embeddings,
heads (``lm_head``), routers (Hugging Face MoE's ``mlp.gate``; not ``gate_proj`` / ``gate_up``)
and norms. fastpar's own embedding, head and router are not linear layers: never fp8."""


def parse_patterns(text: str | None) -> tuple[str, ...] | None:
    """Comma-separated fnmatch patterns (``--fp8-exclude``); None or "default": None."""
    if text is None or text.strip() == "default":
        return None
    return tuple(p.strip() for p in text.split(",") if p.strip())


def selected(fqn: str, exclude=None, include=("*",)) -> bool:
    """Whether the filter puts the module named ``fqn`` in fp8: some pattern of ``include``
    matches it and none of ``exclude`` (None: ``DEFAULT_EXCLUDE``)."""
    exclude = DEFAULT_EXCLUDE if exclude is None else exclude
    matches = lambda pats: any(fnmatchcase(fqn, p) for p in pats)  # noqa: E731
    return matches(include) and not matches(exclude)


def fp8_gemm_available(device: torch.device) -> bool:
    """Whether ``device`` has fp8 GEMMs: a CPU (torch._scaled_mm's CPU kernel, tensorwise and
    rowwise; fastpar's emulation for the rest), a CUDA device of compute capability 8.9 or
    more (Ada, Hopper, Blackwell)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def local_dims(module: nn.Module) -> tuple[tuple[str, int], ...]:
    """(what, size) of each dim of ``module``'s fp8 operands on this rank that a scaling group
    may need whole: the reduction dim K, the output dim N (a fused column layer: each block's
    share)."""
    world = group_size(module.group)
    if isinstance(module, ColumnParallelLinear):
        share = module.out_features // module.fused // world
        what = "each fused block's rows per rank" if module.fused > 1 else "output rows per rank"
        out = share if module.fused > 1 else module.out_per_rank
        return (("in_features", module.in_features), (what, out))
    return (("in_features per rank", module.in_per_rank), ("out_features", module.out_features))


def check_experts(fqn: str, moe: MoE, recipe: fp8.Fp8Recipe) -> None:
    """``check_layer`` for a ``MoE``'s routed experts: the hidden size and the FFN width per
    rank (each of gate and up) multiples of the recipe's; refused in the sequence layout, whose
    TP ranks would scale each expert's tokens apart, and with overlap chunks (per chunk)."""
    multiple = MULTIPLE[recipe.granularity("weight")]
    width = moe.ffn_hidden_size // (moe.tp if moe.tp_layout == "expert_tp" else 1)
    dims = (("hidden_size", moe.hidden_size), ("ffn_hidden_size per rank", width))
    bad = [f"{what} {n}" for what, n in dims if n % multiple]
    if bad:
        raise ValueError(
            f"fp8 {recipe.name}: {fqn} (MoE experts {moe.hidden_size} -> {moe.ffn_hidden_size}, "
            f"expert tp {moe.tp if moe.tp_layout == 'expert_tp' else 1}) has {', '.join(bad)}, "
            f"not a multiple of {multiple}; keep them in high precision (--fp8-exclude '{fqn}', "
            f"use_fp8(exclude=...)) or use widths that are multiples of {multiple}"
        )
    if moe.overlap_chunks > 1:
        raise ValueError(
            f"fp8: {fqn} runs its experts in {moe.overlap_chunks} chunks of each expert's "
            f"tokens (overlap_chunks), whose fp8 scales would then be per chunk; use "
            f"overlap_chunks=1 (--overlap-chunks 1), or keep its experts in high precision "
            f"(--fp8-exclude '{fqn}')"
        )
    if moe.tp_layout == "sequence":
        raise ValueError(
            f"fp8: {fqn} routes each TP rank's share of the sequence to whole experts, whose "
            f"fp8 scales would then be per rank; use expert_tp=True (--moe-expert-tp), or keep its "
            f"experts in high precision (--fp8-exclude '{fqn}')"
        )


def check_layer(fqn: str, module: nn.Module, recipe: fp8.Fp8Recipe) -> None:
    """One ValueError line naming ``fqn``, its shape and the fix unless every dim of its fp8
    operands is a multiple of the recipe's (16: torch._scaled_mm's; 128: the blocks)."""
    if isinstance(module, MoE):
        return check_experts(fqn, module, recipe)
    multiple = MULTIPLE[recipe.granularity("weight")]
    bad = [f"{what} {n}" for what, n in local_dims(module) if n % multiple]
    if bad:
        kind = type(module).__name__
        raise ValueError(
            f"fp8 {recipe.name}: {fqn} ({kind} {module.in_features} -> {module.out_features}, "
            f"tp {group_size(module.group)}) has {', '.join(bad)}, not a multiple of {multiple}; "
            f"keep it in high precision (--fp8-exclude '{fqn}', use_fp8(exclude=...)) or use "
            f"{'tensorwise or rowwise' if multiple == 128 else 'a --tp that leaves multiples of 16'}"
        )


def use_fp8(
    model: nn.Module,
    recipe: fp8.Fp8Recipe | str | None,
    *,
    exclude=None,
    include=("*",),
    emulate: bool | None = None,
) -> list[str]:
    """Put the GEMMs of ``model``'s tensor-parallel linear layers in fp8 (``recipe``; None:
    back to high precision). The filter: fnmatch patterns of fully qualified names
    (``include``, ``exclude``; None: ``DEFAULT_EXCLUDE``). ``emulate``: allow fastpar's exact
    fp32 emulation where the device has no fp8 GEMM (None: on a CPU only). Returns the names
    put in fp8. Every selected layer is checked before any changes (``check_layer``)."""
    layers = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, MoE))
    ]
    if recipe is None:
        for _, m in layers:
            m.fp8 = None
        return []
    recipe = fp8.recipe_of(recipe)
    chosen = [(name, m) for name, m in layers if selected(name, exclude, include)]
    use = Fp8Use(recipe)
    for name, m in chosen:
        check_layer(name, m, recipe)
        device = (m.w1 if isinstance(m, MoE) else m.weight).device
        if not fp8_gemm_available(device):
            if not (emulate or (emulate is None and device.type == "cpu")):
                raise ValueError(
                    f"fp8: {name} is on {device}, which has no fp8 GEMM (CUDA compute "
                    f"capability 8.9+); train it in bf16 (--precision bf16) or allow the slow "
                    f"fp32 emulation (use_fp8(emulate=True))"
                )
            use = Fp8Use(recipe, native=False)
    for _, m in chosen:
        m.fp8 = use
    return [name for name, _ in chosen]
