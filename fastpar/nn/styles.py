"""Tensor-parallel styles: one record per style a plan names (what module it takes, whether it
takes options, what it swaps the module for, whether its output is split), looked up by name
in one place (``get``; an unknown name is an error naming the known ones)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fastpar import families
from fastpar.moe.hf import block_adapter
from fastpar.moe.hf_block import HFMoEBlock
from fastpar.nn.embedding import VocabParallelEmbedding, is_scaled_embedding
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear, is_conv1d
from fastpar.nn.shared_key import SharedKeyLinear


def linear_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def is_hf_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is an HF MoE block ``fastpar.moe.moe_from_hf`` converts."""
    return block_adapter(module) is not None


def _needs_linear(name: str, module: nn.Module, style: str) -> None:
    if not linear_like(module):
        raise TypeError(
            f"plan style {style!r} needs an nn.Linear or a Hugging Face Conv1D at {name!r}, found "
            f"{type(module).__name__}; plan its linear sub-modules instead"
        )


def _needs_nn_linear(name: str, module: nn.Module, style: str) -> None:
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"plan style {style!r} needs an nn.Linear at {name!r}, found {type(module).__name__}"
        )


def _needs_embedding(name: str, module: nn.Module, style: str) -> None:
    if type(module) is not nn.Embedding and not is_scaled_embedding(module):
        raise TypeError(
            f"plan style {style!r} needs an nn.Embedding (or Hugging Face's scaled word "
            f"embedding) at {name!r}, found {type(module).__name__}"
        )


def _needs_moe_block(name: str, module: nn.Module, style: str) -> None:
    if not is_hf_moe_block(module):
        classes = sorted(c for b in families.moe_blocks() for c in b.classes)
        raise TypeError(
            f"plan style {style!r} needs a Hugging Face MoE block at {name!r} (one of "
            f"{classes}), found {type(module).__name__}"
        )


def _needs_params(name: str, module: nn.Module, style: str) -> None:
    if next(module.parameters(), None) is None:
        raise ValueError(f"plan style {style!r} at {name!r}: the module has no parameters")


def _from_dense(layer: type) -> Callable[..., nn.Module]:
    def swap(module: nn.Module, tp_group, ep_group, **options) -> nn.Module:
        return layer.from_dense(module, group=tp_group, **options)

    return swap


def _experts(block: nn.Module, tp_group, ep_group, **options) -> nn.Module:
    """An HF MoE block -> ``HFMoEBlock`` over the TP group (and the mesh's EP group)."""
    return HFMoEBlock(block, tp_group=tp_group, ep_group=ep_group, **options)


@dataclass(frozen=True)
class Style:
    """One tensor-parallel style."""

    name: str
    """Its name in a plan."""
    check: Callable[[str, nn.Module, str], None]
    """(module name, module, style name): raises if the module does not fit the style."""
    options: bool = True
    """Whether it takes keyword options (``(name, {...})`` in a plan)."""
    swap: Callable[..., nn.Module] | None = None
    """(module, tp_group, ep_group, **options) -> the module put in its place; None: it stays."""
    layer: bool = False
    """Swapped for a fastpar TP layer that owns its parameters' sharding: the probe watches
    its output, not its parameters."""
    declares: bool = False
    """Declares how the module's own parameters are treated (they stay in place)."""
    reduces_grad: bool = False
    """A declaring style whose parameters see only this rank's heads: their gradient is
    all-reduced over TP (the probe must find them on a split activation); a declaring style
    without it keeps them replicated (the probe must find them on whole activations only)."""
    split_output: Callable[[dict], bool] | None = None
    """(options) -> whether the module's output stays split over TP; None: never."""
    skip_unfit: bool = False
    """In a built-in plan, a matched module its ``check`` refuses is left as it is (an MoE
    pattern also matches the dense MLPs between MoE blocks); a caller's plan is still refused."""
    replaces_router: bool = False
    """Swaps a Hugging Face router, whose logits HF's own router aux loss reads
    (``config.output_router_logits=True`` is refused)."""
    vocab_logits: dict | None = None
    """The options that make an LM head of this style leave its logits split over the
    vocabulary (padded), as the vocab-parallel cross-entropy reads them; None: it cannot."""

    def splits_output(self, options: dict) -> bool:
        """Whether the output is split over TP (``split_output``)."""
        return self.split_output is not None and self.split_output(options)

    def fits(self, name: str, module: nn.Module) -> bool:
        """Whether ``check`` accepts ``module``."""
        try:
            self.check(name, module, self.name)
        except (TypeError, ValueError):
            return False
        return True


_STYLES = (
    Style(
        "column",
        _needs_linear,
        swap=_from_dense(ColumnParallelLinear),
        layer=True,
        split_output=lambda options: not options.get("gather_output", False),
        vocab_logits={"pad_output": True, "gather_output": False},
    ),
    Style("row", _needs_linear, swap=_from_dense(RowParallelLinear), layer=True),
    Style("vocab", _needs_embedding, swap=_from_dense(VocabParallelEmbedding), layer=True),
    Style("shared_key", _needs_nn_linear, swap=_from_dense(SharedKeyLinear), layer=True),
    Style("per_head", _needs_params, options=False, declares=True, reduces_grad=True),
    Style("replicate", _needs_params, options=False, declares=True),
    Style("experts", _needs_moe_block, swap=_experts, skip_unfit=True, replaces_router=True),
)
STYLES: dict[str, Style] = {s.name: s for s in _STYLES}
"""name -> style, in the order the docs list them."""


def listing() -> str:
    """The styles' names as the ``--plan`` help and hint list them (read when asked, so a
    style registered later is listed)."""
    return ", ".join(STYLES)


def get(name: str, where: str = "") -> Style:
    """The style called ``name``; ValueError naming the known ones (``where``: the plan entry,
    for the message)."""
    style = STYLES.get(name) if isinstance(name, str) else None
    if style is None:
        where = where or f"{name!r}: "
        raise ValueError(f"{where}style must be one of {list(STYLES)}")
    return style
