"""``--optimizer``'s pieces for ``fastpar.train.build``: the parameter groups, the factory the
data-parallel wrapper builds the optimizer with over its masters, and ``fastpar.verify``'s
float64 reference (docs/muon.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastpar import families
from fastpar.mesh.placement import matrix_heads
from fastpar.models import native
from fastpar.optim import Muon, muon_param_groups
from fastpar.optim.muon_matrices import blocks_of
from fastpar.reference.muon import ExactMuon
from fastpar.reference.optimizer import ExactAdamW


def groups_for(cfg, stage, adamw_groups: Callable) -> list[dict]:
    """The optimizer's parameter groups of ``stage``: ``adamw_groups(stage, weight_decay)``
    for AdamW; for Muon ``fastpar.optim.muon_param_groups`` (its default rule)."""
    if cfg.optimizer.name == "muon" and cfg.hf_config:
        check_hf_muon(cfg)
    check_per_head(cfg)
    make = muon_param_groups if cfg.optimizer.name == "muon" else adamw_groups
    return make(stage, cfg.weight_decay)


def check_per_head(cfg) -> None:
    """Refuse ``--muon-per-head`` where no weight marks its heads (``mark_heads``: fastpar's
    GPT and Llama do): AdamW, DeepSeek's latent attention, Hugging Face models (docs/muon.md)."""
    if not cfg.optimizer.muon_per_head:
        return
    model = f"--hf-config {cfg.hf_config}" if cfg.hf_config else f"--model {cfg.model_type}"
    if (
        cfg.optimizer.name != "muon"
        or cfg.hf_config
        or not native.get(cfg.model_type).per_head_muon
    ):
        raise ValueError(
            f"--muon-per-head with --optimizer {cfg.optimizer.name} {model}: only Muon on fastpar's "
            "GPT and Llama splits attention heads (DeepSeek's latent attention and Hugging Face "
            "models are not marked per head); drop --muon-per-head"
        )


def check_hf_muon(cfg) -> None:
    """Refuse ``--optimizer muon`` for a Hugging Face family whose matrices one process cannot
    tell apart: fused blocks (GPT-2's ``c_attn``) or experts stacked in one tensor are marked
    only by the TP / EP plan, so the single-process run (and ``fastpar.verify``'s reference)
    would orthogonalise them as one matrix (docs/muon.md)."""
    from fastpar.models.hf import load_config  # transformers: on use

    model_type = load_config(cfg.hf_config).model_type
    family = families.find(model_type)
    fused = [k for k, v in ((family and family.plan) or {}).items() if "fused" in str(v)]
    if family is not None and (family.moe is not None or fused):
        what = f"fused weights {fused}" if fused else "experts stacked in one tensor"
        raise ValueError(
            f"--optimizer muon with --hf-config {model_type}: its {what} are separate matrices "
            "that only the parallel plan marks, so one process would orthogonalise them as one; "
            "use --optimizer adamw for this family (or fastpar's own --model with --optimizer "
            "muon)"
        )


def muon_factory(cfg) -> Callable | None:
    """``groups -> Muon`` for ``--optimizer muon`` (None for AdamW): one ``--lr`` for both parts
    (the update's RMS matched to AdamW's, ``adjust_lr="match_rms_adamw"``)."""
    if cfg.optimizer.name != "muon":
        return None
    return lambda groups: Muon(
        groups,
        lr=cfg.lr,
        momentum=cfg.optimizer.muon_momentum,
        per_head=cfg.optimizer.muon_per_head,
    )


def exact_optimizer(
    cfg, groups: list[dict], clip: float | None, state_dtype=torch.float32
) -> ExactAdamW:
    """The same step in float64: ``ExactAdamW`` (its moments stored rounded to ``state_dtype``),
    or for Muon ``ExactMuon``."""
    if cfg.optimizer.name != "muon":
        return ExactAdamW(groups, lr=cfg.lr, max_grad_norm=clip, state_dtype=state_dtype)
    return ExactMuon(
        groups,
        lr=cfg.lr,
        max_grad_norm=clip,
        momentum=cfg.optimizer.muon_momentum,
        blocks=blocks_of,
        per_head=cfg.optimizer.muon_per_head,
        heads=matrix_heads,
    )
