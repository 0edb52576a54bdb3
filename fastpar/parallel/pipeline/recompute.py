"""Selective activation recompute: which parts of each transformer block keep their activations.

    policy = RecomputePolicy.parse("attention")    # none | full | attention | mlp | every:K
    apply_recompute(blocks[1:-1], policy)          # the decoder layers, before partitioning

The policies, the mechanism (non-reentrant checkpoints) and what it composes with:
docs/pipelines.md ("Selective recompute")."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastpar.parallel.pipeline.protocols import forward_state_kept, keeping_state

ATTENTION_NAMES = ("attn", "self_attn")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")
POLICIES = "none, full, attention, mlp or every:K (K >= 1)"


@dataclass(frozen=True)
class RecomputePolicy:
    """``kind``: "none", "full", "attention", "mlp" or "every"; ``every``: K of "every:K"."""

    kind: str = "none"
    every: int = 0

    @classmethod
    def parse(cls, value: str | bool | RecomputePolicy | None) -> RecomputePolicy:
        """A policy from its text ("every:2"), a bool (True: full, False: none) or None."""
        if isinstance(value, RecomputePolicy):
            return value
        if value is None or value is False:
            return cls("none")
        if value is True:
            return cls("full")
        text = str(value).strip().lower()
        if text in ("none", "full", "attention", "mlp"):
            return cls(text)
        if text.startswith("every:"):
            k = text.split(":", 1)[1]
            if k.isdigit() and int(k) >= 1:
                return cls("every", int(k))
        raise ValueError(f"--recompute {value!r}: use {POLICIES}")

    @property
    def selective(self) -> bool:
        """Whether the policy checkpoints regions inside the blocks (not none, not full)."""
        return self.kind in ("attention", "mlp", "every")

    def __str__(self) -> str:
        return f"every:{self.every}" if self.kind == "every" else self.kind


def _child(block: nn.Module, names: Sequence[str], what: str) -> nn.Module:
    for name in names:
        child = getattr(block, name, None)
        if isinstance(child, nn.Module):
            return child
    raise ValueError(
        f"recompute {what}: block {type(block).__name__} has no {what} sub-module (looked for "
        f"{', '.join(names)}); use --recompute every:K or full for this model"
    )


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Checkpoint ``module``'s forward in place (``torch.utils.checkpoint``, non-reentrant, RNG
    state preserved); a no-op under no_grad and for a module already checkpointed. Refused for a
    module whose forward is already compiled (compile after applying the policy)."""
    if getattr(module, "_fastpar_recompute", False):
        return module
    if getattr(module, "_fastpar_compiled", False):
        raise ValueError(
            f"{type(module).__name__} is already compiled: apply the recompute policy before "
            "torch.compile (fastpar.train compiles after building)"
        )
    inner = module.forward
    kept = keeping_state(module)  # an MoE's aux_loss and stats (protocols.ForwardState)

    def recomputing():  # the first forward runs as it is; the recomputation keeps the state
        return contextlib.nullcontext(), forward_state_kept(kept)

    kw = {"context_fn": recomputing} if kept else {}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kw, **kwargs)

    module.forward = forward
    module._fastpar_recompute = True
    return module


def apply_recompute(
    layers: Sequence[nn.Module], policy: str | bool | RecomputePolicy
) -> list[nn.Module]:
    """Apply a selective ``policy`` to ``layers`` (the model's decoder layers, all of them, in
    order: "every:K" counts from the first). Returns the modules checkpointed; none for "none"
    and "full" (the engine's). Raises ValueError naming a block without the sub-module."""
    policy = RecomputePolicy.parse(policy)
    if not policy.selective:
        return []
    if policy.kind == "every":
        chosen = [b for i, b in enumerate(layers) if i % policy.every == 0]
    elif policy.kind == "attention":
        chosen = [_child(b, ATTENTION_NAMES, "attention") for b in layers]
    else:
        chosen = [_child(b, MLP_NAMES, "mlp") for b in layers]
    return [checkpoint_module(m) for m in chosen]
