"""``--optimizer``'s pieces for ``fastpar.train.build``: the parameter groups, the factory the
data-parallel wrapper builds the optimizer with over its masters, and ``fastpar.verify``'s
float64 reference (docs/muon.md)."""

from __future__ import annotations

from collections.abc import Callable

from fastpar.optim import Muon, muon_param_groups
from fastpar.optim.muon_matrices import blocks_of
from fastpar.reference.muon import ExactMuon
from fastpar.reference.optimizer import ExactAdamW


def groups_for(cfg, stage, adamw_groups: Callable) -> list[dict]:
    """The optimizer's parameter groups of ``stage``: ``adamw_groups(stage, weight_decay)``
    for AdamW; for Muon ``fastpar.optim.muon_param_groups`` (its default rule)."""
    make = muon_param_groups if cfg.optimizer == "muon" else adamw_groups
    return make(stage, cfg.weight_decay)


def muon_factory(cfg) -> Callable | None:
    """``groups -> Muon`` for ``--optimizer muon`` (None for AdamW): one ``--lr`` for both parts
    (the update's RMS matched to AdamW's, ``adjust_lr="match_rms_adamw"``)."""
    if cfg.optimizer != "muon":
        return None
    return lambda groups: Muon(groups, lr=cfg.lr, momentum=cfg.muon_momentum)


def exact_optimizer(cfg, groups: list[dict], clip: float | None) -> ExactAdamW:
    """The same step in float64: ``ExactAdamW``, or for Muon ``ExactMuon``."""
    if cfg.optimizer != "muon":
        return ExactAdamW(groups, lr=cfg.lr, max_grad_norm=clip)
    return ExactMuon(
        groups, lr=cfg.lr, max_grad_norm=clip, momentum=cfg.muon_momentum, blocks=blocks_of
    )
