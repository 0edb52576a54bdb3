"""A small decoder-only GPT built only from fastpar layers, expressed as pipeline blocks.

    blocks = build_gpt(GPTConfig(...), mesh)      # [Embedding, Block x layers, Head]
    loss = gpt_loss(logits, targets, cfg, mesh)   # vocab-parallel cross-entropy

Heads split over TP, MLP or MoE blocks, RMSNorm or LayerNorm, a head tied across stages or
untied, optional sequence parallelism. Every rank draws all weights from the same seed and keeps
its slices, so any layout starts from the single-process weights; no dropout."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.cliutil import option
from fastpar.comm import group_size
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_heads
from fastpar.models.activations import Activations, activations
from fastpar.models.common import (
    DecoderBlock,
    Head,
    Norm,
    attend,
    build_decoder,
    check_layout,
    lm_loss,
    moe_block,
    untie_for_pipeline,
)
from fastpar.models.llama import check_routing, routing_options, sync_routing
from fastpar.models.shape import MODEL, DecoderShape
from fastpar.moe.config import ExpertConfig, RouterConfig
from fastpar.nn import ColumnParallelLinear, RowParallelLinear

__all__ = ["Block", "GPTConfig", "Head", "Norm", "build_gpt", "gpt_loss", "untie_for_pipeline"]


@dataclass(frozen=True)
class GPTConfig(DecoderShape):
    """Model shape and options of the GPT: ``DecoderShape``'s fields (``ffn`` None: 4·hidden)
    and its own below; the MoE routing options are ``moe_router`` and ``moe_experts``
    (``fastpar.moe.config`` documents their fields; GELU experts, shared ones alike)."""

    norm: str = option(
        "rmsnorm",
        MODEL,
        words=("rmsnorm", "layernorm"),
        help="gpt: the normalisation layers",
        resume="refuse",
    )
    tie_embeddings: bool = True
    moe_router: RouterConfig = field(default_factory=RouterConfig)
    """How the MoE blocks route; its ``capacity_factor`` follows the model's
    (``fastpar.models.llama.sync_routing``)."""
    moe_experts: ExpertConfig = field(default_factory=ExpertConfig)
    """What the MoE blocks' experts compute (GELU MLPs with biases; shared experts)."""

    def __post_init__(self) -> None:
        sync_routing(self)

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    def activation_bytes(
        self, tp: int = 1, sp: int = 1, size: int = 4, fused_ce: bool = False
    ) -> Activations:
        """Bytes per token each kind of block keeps for backward on one rank
        (``fastpar.models.activations``): q|k|v in one buffer, the attention output; a GELU
        MLP's fc and GELU outputs."""
        block = dict(attention=4 * self.hidden, mlp=2, expert_ffn=self.ffn_size)
        grads = dict(attention_grads=3 * self.hidden, mlp_in=1)  # q|k|v; fc
        return activations(self, tp, sp, size, fused_ce, self.norm, **block, **grads)

    def check(self, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        """Raise ValueError naming the bad value and the fix, before anything is built."""
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % tp:
            raise ValueError(
                f"heads {self.heads} are not divisible by tp {tp}; use a tp that divides {self.heads}"
            )
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        check_routing(self)
        check_layout(self, tp, pp, ep)


class Attention(nn.Module):
    """Causal self-attention with heads split over TP: [B, T(/tp), H] -> same."""

    def __init__(self, cfg: GPTConfig, group, sp: bool):
        super().__init__()
        tp = group_size(group)
        self.heads_local, self.head_dim = cfg.heads // tp, cfg.hidden // cfg.heads
        kw = dict(group=group, sequence_parallel=sp, sequence_dim=1)
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, bias=False, fused=3, **kw)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, bias=False, **kw)
        mark_heads(self.qkv.weight, 0, self.head_dim)  # Muon(per_head=True): q, k, v per head
        mark_heads(self.proj.weight, 1, self.head_dim)
        self.cp_group, self.cp_attention = None, "ring"  # the block sets them (cp > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        q, k, v = (
            z.view(b, t, self.heads_local, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, -1)
        )
        y = attend(q, k, v, self.cp_group, self.cp_attention)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, group, sp: bool):
        super().__init__()
        kw = dict(group=group, sequence_parallel=sp, sequence_dim=1)
        self.fc = ColumnParallelLinear(cfg.hidden, cfg.ffn_size, **kw)
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.hidden, **kw)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def moe(cfg: GPTConfig, mesh: ParallelMesh | None = None) -> nn.Module:
    """A GPT MoE block: GELU experts with biases, the config's routing options
    (``fastpar.models.llama.routing_options``)."""
    return moe_block(cfg, mesh, **routing_options(cfg))


class Block(DecoderBlock):
    """Pre-norm GPT block: x + attn(norm(x)); x + mlp_or_moe(norm(x))."""

    def __init__(self, cfg: GPTConfig, layer: int, mesh: ParallelMesh | None = None):
        super().__init__(
            cfg, layer, mesh, attention=Attention, mlp=MLP, norm={"kind": cfg.norm}, moe=moe
        )


def build_gpt(cfg: GPTConfig, mesh: ParallelMesh | None = None) -> list[nn.Module]:
    """Every block of the model: [Embedding, Block x cfg.layers, Head]. Draws them in this order
    from the current random stream on every rank (same seed -> same model at any layout)."""
    return build_decoder(cfg, mesh, Block, learned_positions=True, norm=cfg.norm)


#: mean vocab-parallel cross-entropy of logits [B·T, vocab / tp] against targets [B, T]
gpt_loss = lm_loss
