"""The optimizer's options, each declared once (``OptimizerConfig``): which optimizer
``python -m fastpar.train`` / ``fastpar.verify`` step with, and the dtype of its state; each
field is also a flag of the command (``TrainConfig.optimizer`` holds it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastpar.cliutil import option

OPTIMIZER = "training"
"""The --help section of the optimizer's flags (the training flags')."""

OPTIMIZERS = ("adamw", "muon")
STATE_DTYPES = ("fp32", "bf16")
TORCH_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The torch dtype of each ``--optimizer-state-dtype`` word (``FusedAdamW(state_dtype=)``)."""


@dataclass(frozen=True)
class OptimizerConfig:
    """Which optimizer and its state's dtype (flags ``--optimizer``,
    ``--optimizer-state-dtype``)."""

    name: str = option(
        "adamw",
        name="optimizer",
        group=OPTIMIZER,
        words=OPTIMIZERS,
        help="the optimizer: adamw, or muon (Newton-Schulz orthogonalised momentum on each whole "
        "2-D hidden matrix, AdamW on the rest)",
        resume="refuse",
    )
    muon_momentum: float = option(
        0.95,
        group=OPTIMIZER,
        help="--optimizer muon: the momentum of its matrices (Nesterov; AdamW's betas for the "
        "rest)",
        resume="warn",
    )
    """Muon's momentum, in [0, 1)."""
    muon_per_head: bool = option(
        False,
        group=OPTIMIZER,
        help="--optimizer muon: orthogonalise each attention head's rows of q|k|v and columns "
        "of the output projection apart (GPT, Llama; not DeepSeek's latent attention)",
        resume="refuse",
    )
    """``Muon(per_head=True)``: each head of a ``mark_heads`` weight its own matrix."""
    state_dtype: str = option(
        "fp32",
        name="optimizer_state_dtype",
        group=OPTIMIZER,
        words=STATE_DTYPES,
        help="dtype of the optimizer's moments: fp32, or bf16 (updated in fp32, stored rounded "
        "to nearest; 4 of AdamW's 12 bytes a parameter saved)",
        resume="refuse",
    )

    def __post_init__(self) -> None:
        for value, words, what in (
            (self.name, OPTIMIZERS, "--optimizer"),
            (self.state_dtype, STATE_DTYPES, "--optimizer-state-dtype"),
        ):
            if value not in words:
                raise ValueError(f"{what} {value!r} must be one of {', '.join(words)}")
