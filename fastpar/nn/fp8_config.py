"""The fp8 options of ``python -m fastpar.train --precision fp8`` (``Fp8Config``), each declared
once: the recipe and the module filter. ``TrainConfig.fp8`` holds it; each field is a flag of
the command under its flat name (``fastpar.train.config.flag_specs``)."""

from __future__ import annotations

from dataclasses import dataclass

from fastpar.cliutil import option
from fastpar.nn.fp8_apply import DEFAULT_EXCLUDE, parse_patterns
from fastpar.ops.fp8 import RECIPES

FP8 = "training"
"""The --help section of the fp8 flags (the training flags')."""


@dataclass(frozen=True)
class Fp8Config:
    """How ``--precision fp8`` scales (``--fp8-recipe``) and which linear layers it takes
    (``--fp8-exclude``)."""

    recipe: str = option(
        "tensorwise",
        name="fp8_recipe",
        group=FP8,
        words=RECIPES,
        help="--precision fp8: tensorwise (one scale per tensor, e5m2 gradients), rowwise (one "
        "power-of-two scale per row, e4m3) or blockwise (DeepSeek-V3: 1x128 activations and "
        "gradients, 128x128 weights, e4m3)",
        resume="warn",
    )
    """A name of ``fastpar.ops.fp8.RECIPES``."""
    exclude: str = option(
        "default",
        name="fp8_exclude",
        group=FP8,
        metavar="PATTERNS",
        help="--precision fp8: comma-separated fnmatch patterns of the module names kept in "
        f"bf16 (default: {','.join(DEFAULT_EXCLUDE)}; '' puts every linear layer in fp8)",
        resume="warn",
    )
    """``default`` (``fastpar.nn.fp8_apply.DEFAULT_EXCLUDE``) or comma-separated patterns."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"--fp8-recipe {self.recipe!r} must be one of {', '.join(RECIPES)}")

    @property
    def exclude_patterns(self) -> tuple[str, ...] | None:
        """The patterns of ``exclude`` (None: the default ones)."""
        return parse_patterns(self.exclude)
