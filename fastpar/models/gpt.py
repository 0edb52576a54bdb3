"""A small decoder-only GPT built only from fastpar layers, expressed as pipeline blocks.

    blocks = build_gpt(GPTConfig(...), mesh)      # [Embedding, Block x layers, Head]
    stage, (start, end) = build_stage(blocks, mesh.pp_size, mesh.pp_rank, costs=[1] * len(blocks))
    logits = stage(ids)                           # on a one-stage pipeline: [B·T, vocab / tp]
    loss = gpt_loss(logits, targets, cfg, mesh)   # vocab-parallel cross-entropy

Layers: vocab-parallel token embedding + learned positions; attention with heads split over TP
(a fused q|k|v ColumnParallelLinear, causal SDPA, a RowParallelLinear); an MLP
(column -> GELU -> row) or, every ``moe_every``-th block, a fastpar MoE over the EP group;
RMSNorm or LayerNorm; an LM head tied to the embedding (across the first and last pipeline stage
when pp > 1) or untied; optional sequence parallelism (activations between blocks are split along
the sequence over TP). Every rank draws every block's weights from the same seed (Megatron's
CPU-init idea) and keeps its slices, so any layout starts from the single-process model's exact
weights. No dropout: runs must be reproducible across layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.comm import all_gather_reduce_scatter, copy_to_region, group_size, scatter_to_sequence
from fastpar.moe import MoE
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.nn.functional import vocab_parallel_cross_entropy
from fastpar.nn.marks import mark_sharded, param_layout


@dataclass(frozen=True)
class GPTConfig:
    """Model shape and options.

    vocab_size: tokens (256 for byte-level text). seq_len: context length. hidden: model width.
    heads: attention heads (divisible by TP). layers: transformer blocks. ffn: MLP width
    (default 4·hidden). moe_every: every n-th block is MoE (0: none). num_experts, top_k,
    capacity_factor (None: dropless), overlap_chunks: MoE options. norm: "rmsnorm" or
    "layernorm". tie_embeddings: LM head shares the embedding. sequence_parallel: split
    activations along the sequence over TP between blocks.
    """

    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    ffn: int | None = None
    moe_every: int = 0
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None
    overlap_chunks: int = 1
    norm: str = "rmsnorm"
    tie_embeddings: bool = True
    sequence_parallel: bool = False

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    def is_moe(self, layer: int) -> bool:
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0

    def check(self, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        """Raise ValueError naming the bad value and the fix, before anything is built."""
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % tp:
            raise ValueError(
                f"heads {self.heads} are not divisible by tp {tp}; use a tp that divides {self.heads}"
            )
        if self.ffn_size % tp:
            raise ValueError(f"ffn {self.ffn_size} is not divisible by tp {tp}")
        if self.layers + 2 < pp:
            raise ValueError(
                f"the model has {self.layers + 2} pipeline blocks (embedding, {self.layers} layers, head) "
                f"but pp={pp}: use pp <= {self.layers + 2} or more layers"
            )
        if self.moe_every and self.num_experts % ep:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by ep {ep}")
        if ep > 1 and not self.moe_every:
            raise ValueError(f"ep={ep} needs MoE layers: set moe_every (e.g. 2)")
        if self.sequence_parallel and tp > 1 and self.seq_len % tp:
            raise ValueError(
                f"sequence_parallel: seq_len {self.seq_len} is not divisible by tp {tp}"
            )
        if self.sequence_parallel and tp > 1 and self.moe_every:
            raise ValueError(
                "sequence_parallel with MoE blocks and tp > 1 is not supported: the experts and "
                "router would see different tokens on each TP rank; drop one of the two"
            )
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim. Under sequence parallelism each TP rank normalises
    different tokens, so its weight gradient is partial: copy_to_region all-reduces it."""

    def __init__(self, dim: int, kind: str, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.kind, self.group, self.sp = kind, group, sequence_parallel
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_region(self.weight, self.group) if self.sp else self.weight
        if self.kind == "layernorm":
            b = copy_to_region(self.bias, self.group) if self.sp else self.bias
            return F.layer_norm(x, (x.shape[-1],), w, b)
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


class Attention(nn.Module):
    """Causal self-attention with heads split over TP: [B, T(/tp), H] -> same."""

    def __init__(self, cfg: GPTConfig, group, sp: bool):
        super().__init__()
        tp = group_size(group)
        self.heads_local, self.head_dim = cfg.heads // tp, cfg.hidden // cfg.heads
        kw = dict(group=group, sequence_parallel=sp, sequence_dim=1)
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, bias=False, fused=3, **kw)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        q, k, v = (
            z.view(b, t, self.heads_local, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, group, sp: bool):
        super().__init__()
        kw = dict(group=group, sequence_parallel=sp, sequence_dim=1)
        self.fc = ColumnParallelLinear(cfg.hidden, cfg.ffn_size, **kw)
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.hidden, **kw)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp_or_moe(norm(x))."""

    def __init__(self, cfg: GPTConfig, layer: int, mesh=None):
        super().__init__()
        group = mesh.tp_group if mesh is not None else None
        sp = cfg.sequence_parallel and group_size(group) > 1
        self.norm1 = Norm(cfg.hidden, cfg.norm, group, sp)
        self.attn = Attention(cfg, group, sp)
        self.norm2 = Norm(cfg.hidden, cfg.norm, group, sp)
        if cfg.is_moe(layer):
            self.mlp = MoE(
                cfg.hidden, cfg.ffn_size, cfg.num_experts, cfg.top_k,
                capacity_factor=cfg.capacity_factor, overlap_chunks=cfg.overlap_chunks, mesh=mesh,
            )  # fmt: skip
        else:
            self.mlp = MLP(cfg, group, sp)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """ids [B, T] -> [B, T(/tp), H]: vocab-parallel tokens + learned positions."""

    def __init__(self, cfg: GPTConfig, mesh=None):
        super().__init__()
        group = mesh.tp_group if mesh is not None else None
        self.group, self.sp = group, cfg.sequence_parallel and group_size(group) > 1
        self.tok = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, group=group)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"GPT expects token ids [batch, seq], got {tuple(ids.shape)}")
        if ids.shape[1] > self.pos.num_embeddings:
            raise ValueError(
                f"sequence of {ids.shape[1]} tokens is longer than seq_len {self.pos.num_embeddings}"
            )
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return scatter_to_sequence(x, self.group, dim=1) if self.sp else x


class Head(nn.Module):
    """[B, T(/tp), H] -> logits [B·T, vocab / tp] (this rank's vocabulary shard)."""

    def __init__(self, cfg: GPTConfig, weight: nn.Parameter, mesh=None):
        super().__init__()
        group = mesh.tp_group if mesh is not None else None
        self.group, self.sp = group, cfg.sequence_parallel and group_size(group) > 1
        self.norm = Norm(cfg.hidden, cfg.norm, group, self.sp)
        self.weight = weight

    def forward(self, x):
        x = self.norm(x)
        x = (
            all_gather_reduce_scatter(x, self.group, dim=1)
            if self.sp
            else copy_to_region(x, self.group)
        )
        return F.linear(x, self.weight).flatten(0, 1)


def build_gpt(cfg: GPTConfig, mesh=None) -> list[nn.Module]:
    """Every block of the model: [Embedding, Block x cfg.layers, Head]. Draws them in this order
    from the current random stream on every rank (same seed -> same model at any layout)."""
    tp = mesh.tp_size if mesh is not None else 1
    cfg.check(tp, mesh.pp_size if mesh is not None else 1, mesh.ep_size if mesh is not None else 1)
    embed = Embedding(cfg, mesh)
    with torch.no_grad():  # GPT-2's 0.02 scale (nn.Embedding draws N(0, 1)); same on every layout
        embed.tok.weight.mul_(0.02)
        embed.pos.weight.mul_(0.02)
    blocks = [Block(cfg, i, mesh) for i in range(cfg.layers)]
    if cfg.tie_embeddings:
        weight = embed.tok.weight
    else:
        head = ColumnParallelLinear(
            cfg.hidden, cfg.vocab_size, bias=False, pad_output=True,
            group=mesh.tp_group if mesh is not None else None,
        )  # fmt: skip
        weight = head.weight
    return [embed, *blocks, Head(cfg, weight, mesh)]


def untie_for_pipeline(blocks: list[nn.Module], mesh) -> nn.Parameter | None:
    """With pp > 1 the embedding (first stage) and a tied head (last stage) live on different
    ranks: give the head its own copy of the weight, marked and synced as tied. Returns the
    tied parameter this rank holds (None if it holds neither end)."""
    head, embed = blocks[-1], blocks[0]
    if head.weight is not embed.tok.weight:
        return None
    if mesh is None or mesh.pp_size == 1:
        return None
    if mesh.is_last_stage:
        copy = nn.Parameter(embed.tok.weight.detach().clone())
        layout = param_layout(embed.tok.weight)
        mark_sharded(copy, layout.dim, layout.group, layout.full_size)
        head.weight = copy
        return copy
    return embed.tok.weight if mesh.is_first_stage else None


def gpt_loss(
    logits: torch.Tensor, targets: torch.Tensor, cfg: GPTConfig, mesh=None
) -> torch.Tensor:
    """Mean vocab-parallel cross-entropy of logits [B·T, vocab / tp] against targets [B, T]."""
    group = mesh.tp_group if mesh is not None else None
    return vocab_parallel_cross_entropy(
        logits, targets.reshape(-1), group=group, vocab_size=cfg.vocab_size
    )
