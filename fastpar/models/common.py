"""Pieces every fastpar decoder shares: the pipeline-block protocol's embedding and head, the
pre-norm block, RMSNorm / LayerNorm, the MoE block, the checks that depend only on the layout,
the tied-embedding split across pipeline stages and the vocab-parallel loss.

A model is a list of pipeline blocks ``[Embedding, DecoderBlock x layers, Head]``: each takes
and returns one tensor (ids [B, T] -> [B, T(/tp), H] -> ... -> logits [B·T, vocab / tp]), so
``build_stage``, ``PipelineEngine``, DDP / ZeRO, checkpoints and the trainer work for any of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastpar.comm import (
    all_gather_reduce_scatter,
    copy_to_region,
    group_rank,
    group_size,
    plain,
    scatter_to_sequence,
)
from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_sharded, mark_tied_copy, param_layout
from fastpar.models.documents import current as current_documents
from fastpar.moe import MoE
from fastpar.nn import ColumnParallelLinear, VocabParallelEmbedding
from fastpar.nn.functional import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from fastpar.ops.documents import document_attention
from fastpar.parallel.context import (
    all_to_all_attention,
    local_positions,
    ring_attention,
    split_sequence,
)
from fastpar.reference.precision import upcast

IGNORE_INDEX = -100
"""Targets that count for nothing in ``lm_loss`` (the cross-entropy's default)."""


class LossGroups(NamedTuple):
    """The groups ``lm_loss`` communicates over, read off a mesh once (``loss_groups``): the
    vocabulary's (tp) and the sequence's (cp; None without context parallelism)."""

    tp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None


def loss_groups(mesh: ParallelMesh | LossGroups | None) -> LossGroups:
    """The ``LossGroups`` of ``mesh`` (a ``LossGroups`` as it is; None: no parallelism)."""
    if isinstance(mesh, LossGroups):
        return mesh
    return LossGroups(as_group(mesh), as_group(mesh, "context"))


def cp_split(x: torch.Tensor, cp_group) -> torch.Tensor:
    """This cp rank's chunks of ``x`` [B, T, ...] (``cp_group`` None: no context parallelism,
    ``x`` itself)."""
    return x if cp_group is None else split_sequence(x, cp_group, dim=1)


def positions(t: int, cp_group, device) -> torch.Tensor:
    """Global positions [t] of this rank's ``t`` tokens: 0..t-1, or under context parallelism
    the load-balanced chunks' (``fastpar.parallel.context``; the sequence is t · cp long).
    Inside packed documents (``fastpar.models.documents``) with ``reset_positions``: [B, t],
    each token's position in its document."""
    docs = current_documents()
    if docs is not None and docs.reset_positions:
        cp = 1 if cp_group is None else group_size(cp_group)
        pos = docs.positions().to(device)
        if pos.shape[1] != t * cp:
            raise ValueError(
                f"the documents describe rows of {pos.shape[1]} tokens but the layer holds {t}"
                + (f" on each of {cp} cp ranks" if cp > 1 else "")
            )
        # whole rows' positions: under cp this rank's chunks of them
        return pos if cp == 1 else split_sequence(pos, cp_group, dim=1)
    if cp_group is None:
        return torch.arange(t, device=device)
    cp = group_size(cp_group)
    return local_positions(t * cp, cp, group_rank(cp_group), device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group=None,
    kind: str = "ring",
    *,
    scale: float | None = None,
):
    """Causal attention: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (Hq a multiple
    of Hkv; Dv may differ from D) -> [B, Hq, T, Dv]; over the whole sequence under context
    parallelism, by ring attention or (``kind`` "all-to-all") head-scattering all-to-alls
    (``fastpar.parallel.context``). ``scale``: the softmax scale, default 1/sqrt(D)."""
    docs = current_documents()
    if docs is not None:  # packed rows: attention stops at each document's start
        ids = docs.ids.to(q.device)  # whole rows, also under context parallelism
        if cp_group is None:
            return document_attention(q, k, v, ids, scale)
        if kind == "all-to-all":
            return all_to_all_attention(q, k, v, cp_group, scale=scale, doc_ids=ids)
        return ring_attention(q, k, v, cp_group, scale=scale, doc_ids=ids)
    if cp_group is not None:
        if kind == "all-to-all":
            return all_to_all_attention(q, k, v, cp_group, scale=scale)
        return ring_attention(q, k, v, cp_group, scale=scale)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # key/value head j serves query heads j·rep .. j·rep + rep - 1
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def check_sizes(cfg, names: tuple[str, ...]) -> None:
    """Raise ValueError for the first of the fields ``names`` of ``cfg`` below 1."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")


def check_layout(cfg, tp: int, pp: int, ep: int) -> None:
    """The checks every decoder config shares (``cfg`` has ffn_size, layers, moe_every,
    num_experts, seq_len, sequence_parallel). Raises ValueError naming the value and the fix."""
    if cfg.vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {cfg.vocab_size}")
    if cfg.ffn_size % tp and cfg.moe_every != 1:  # moe_every 1: no dense MLP to split
        raise ValueError(
            f"ffn {cfg.ffn_size} is not divisible by tp {tp}; use an ffn that is a multiple of {tp}"
        )
    if cfg.layers + 2 < pp:
        raise ValueError(
            f"the model has {cfg.layers + 2} pipeline blocks (embedding, {cfg.layers} layers, head) "
            f"but pp={pp}: use pp <= {cfg.layers + 2} or more layers"
        )
    if cfg.moe_every and cfg.num_experts % ep:
        raise ValueError(f"num_experts {cfg.num_experts} is not divisible by ep {ep}")
    if ep > 1 and not cfg.moe_every:
        raise ValueError(f"ep={ep} needs MoE layers: set moe_every (e.g. 2)")
    if cfg.sequence_parallel and tp > 1 and cfg.seq_len % tp:
        raise ValueError(f"sequence_parallel: seq_len {cfg.seq_len} is not divisible by tp {tp}")
    expert_tp = getattr(cfg, "moe_expert_tp", False)
    sp_moe = cfg.sequence_parallel and tp > 1 and cfg.moe_every
    if sp_moe and not expert_tp and cfg.capacity_factor is not None:
        raise ValueError(
            f"sequence_parallel MoE at tp={tp} routes each TP rank's chunk of the sequence, "
            f"and capacity_factor={cfg.capacity_factor} would drop per chunk (other tokens "
            "than the single-process model): use dropless routing (capacity_factor None) "
            "or split the experts over TP (moe_expert_tp), which routes the whole sequence"
        )
    if expert_tp and cfg.moe_every and _moe_width(cfg) % tp:
        raise ValueError(
            f"moe_expert_tp: the expert width {_moe_width(cfg)} is not divisible by tp {tp}; "
            f"use an expert width that is a multiple of {tp}"
        )


def _moe_width(cfg) -> int:
    width = getattr(cfg, "moe_ffn", None)
    return cfg.ffn_size if width is None else width


def moe_block(cfg, mesh: ParallelMesh | None = None, *, ffn: int | None = None, **options) -> MoE:
    """The MoE that replaces a block's MLP (experts over the mesh's EP group): ``ffn`` wide (default
    ``cfg.ffn_size``); ``options`` go to ``MoE`` (e.g. ``expert="swiglu"``). At tp > 1 it follows
    the model: sequence parallel when the model is (its input is this rank's chunk [B, T/tp, H]),
    experts split over TP when ``cfg.moe_expert_tp`` (``fastpar.moe.tp``)."""
    return MoE(
        cfg.hidden,
        ffn if ffn is not None else cfg.ffn_size,
        cfg.num_experts,
        cfg.top_k,
        capacity_factor=cfg.capacity_factor,
        overlap_chunks=cfg.overlap_chunks,
        mesh=mesh,
        sequence_parallel=cfg.sequence_parallel,
        expert_tp=getattr(cfg, "moe_expert_tp", False),
        sequence_dim=1,
        **options,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as HF Llama computes it: normalise in fp32, cast back to the
    input's dtype, then scale by ``weight`` (float64 stays float64)."""
    h = upcast(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Norm(nn.Module):
    """RMSNorm (``rms_norm``) or LayerNorm over the last dim [..., dim] -> same; ``eps``
    defaults to 1e-6 (RMSNorm) or 1e-5 (LayerNorm, torch's default).

    ``partial_grad``: this rank's weight gradient is a partial sum, because the rank sees only
    part of what the weight is applied to (other TP ranks hold other tokens under sequence
    parallelism, or other heads for a per-head q/k norm); copy_to_region then all-reduces the
    weight's gradient over ``group`` in backward.
    """

    def __init__(
        self,
        dim: int,
        kind: str = "rmsnorm",
        *,
        eps: float | None = None,
        group=None,
        partial_grad: bool = False,
    ):
        super().__init__()
        if kind not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {kind!r}")
        if eps is None:
            eps = 1e-6 if kind == "rmsnorm" else 1e-5
        self.kind, self.eps, self.group, self.partial_grad = kind, eps, group, partial_grad
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layernorm" else None

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        return copy_to_region(p, self.group) if self.partial_grad else p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._full(self.weight)
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, self._full(self.bias), self.eps)
        return rms_norm(x, w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.kind}, eps={self.eps}, partial={self.partial_grad}"


class Embedding(nn.Module):
    """ids [B, T] -> [B, T(/cp)(/tp), H]: vocab-parallel tokens (+ learned positions when
    ``learned_positions``); under context parallelism this rank's chunks of the sequence
    (``fastpar.parallel.context``), then split along the sequence over TP under sequence
    parallelism."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        seq_len: int,
        mesh: ParallelMesh | None = None,
        *,
        sequence_parallel: bool = False,
        learned_positions: bool = False,
    ):
        super().__init__()
        group = as_group(mesh)
        self.group, self.seq_len = group, seq_len
        self.sp = sequence_parallel and group_size(group) > 1
        self.cp_group = as_group(mesh, "context")
        self.tok = VocabParallelEmbedding(vocab_size, hidden, group=group)
        self.pos = nn.Embedding(seq_len, hidden) if learned_positions else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"the model expects token ids [batch, seq], got {tuple(ids.shape)}")
        if ids.shape[1] > self.seq_len:
            raise ValueError(
                f"sequence of {ids.shape[1]} tokens is longer than seq_len {self.seq_len}"
            )
        ids = cp_split(ids, self.cp_group)
        x = self.tok(ids)
        if self.pos is not None:
            x = x + self.pos(positions(ids.shape[1], self.cp_group, ids.device))
        return scatter_to_sequence(x, self.group, dim=1) if self.sp else x


class DecoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)); x + mlp(norm2(x)). [B, T(/tp), H].

    Built in this order (the random stream's order): norm1, ``attention(cfg, group, sp)``,
    norm2, then ``mlp(cfg, group, sp)`` or, for a MoE layer (``cfg.is_moe(layer)``),
    ``moe(cfg, mesh)`` (default ``moe_block``: the GPT's GELU experts). ``norm``: keyword
    arguments of both ``Norm``s (kind, eps); ``sp``: sequence parallelism is on (and tp > 1), so
    the norms' weight gradients are partial.
    """

    def __init__(
        self,
        cfg,
        layer: int,
        mesh: ParallelMesh | None,
        *,
        attention,
        mlp,
        norm: dict,
        moe=moe_block,
    ):
        super().__init__()
        group = as_group(mesh)
        sp = cfg.sequence_parallel and group_size(group) > 1
        self.norm1 = Norm(cfg.hidden, **norm, group=group, partial_grad=sp)
        self.attn = attention(cfg, group, sp)
        self.attn.cp_group = as_group(mesh, "context")  # under context parallelism: ring or a2a
        self.attn.cp_attention = getattr(cfg, "cp_attention", "ring")
        self.norm2 = Norm(cfg.hidden, **norm, group=group, partial_grad=sp)
        self.mlp = moe(cfg, mesh) if cfg.is_moe(layer) else mlp(cfg, group, sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """[B, T(/tp), H] -> final norm -> logits [B·T, vocab / tp] (this rank's vocabulary shard).
    ``weight`` [vocab / tp, H]: the embedding's (tied) or an untied ColumnParallelLinear's.
    ``return_hidden`` (set by a loop that uses the fused linear cross-entropy): the normed
    hidden states [B·T, H] instead, entered into the TP region as the logits' matmul would be;
    ``lm_loss(..., weight=head.weight)`` then never materialises the logits."""

    def __init__(
        self,
        hidden: int,
        weight: nn.Parameter,
        mesh: ParallelMesh | None = None,
        *,
        norm: str = "rmsnorm",
        eps: float | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        group = as_group(mesh)
        self.group, self.sp = group, sequence_parallel and group_size(group) > 1
        self.norm = Norm(hidden, norm, eps=eps, group=group, partial_grad=self.sp)
        self.weight = weight
        self.return_hidden = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.norm(x))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [B, T(/tp), H] -> logits [B·T, vocab / tp] by ``weight`` (or,
        with ``return_hidden``, the hidden states [B·T, H] entered into the TP region)."""
        x = (
            all_gather_reduce_scatter(x, self.group, dim=1)
            if self.sp
            else copy_to_region(x, self.group)
        )
        if self.return_hidden:
            return x.flatten(0, 1)
        return F.linear(x, self.weight).flatten(0, 1)


def build_decoder(
    cfg,
    mesh: ParallelMesh | None,
    block,
    *,
    learned_positions: bool = False,
    norm: str = "rmsnorm",
    eps=None,
) -> list[nn.Module]:
    """[Embedding, block(cfg, i, mesh) for i < cfg.layers, Head] after ``cfg.check``, drawn in
    this order from the current random stream on every rank (same seed -> the same model at
    any layout). Embeddings scaled to N(0, 0.02) (GPT-2's and HF's initializer_range); the head
    is tied to the token embedding or an untied ColumnParallelLinear (vocabulary padded)."""
    cfg.check(*((mesh.tp_size, mesh.pp_size, mesh.ep_size) if mesh is not None else (1, 1, 1)))
    embed = Embedding(
        cfg.vocab_size,
        cfg.hidden,
        cfg.seq_len,
        mesh,
        sequence_parallel=cfg.sequence_parallel,
        learned_positions=learned_positions,
    )
    with torch.no_grad():  # nn.Embedding draws N(0, 1)
        embed.tok.weight.mul_(0.02)
        if embed.pos is not None:
            embed.pos.weight.mul_(0.02)
    blocks = [block(cfg, i, mesh) for i in range(cfg.layers)]
    if cfg.tie_embeddings:
        weight = embed.tok.weight
    else:
        weight = ColumnParallelLinear(
            cfg.hidden, cfg.vocab_size, bias=False, pad_output=True, group=embed.group
        ).weight
    head = Head(
        cfg.hidden, weight, mesh, norm=norm, eps=eps, sequence_parallel=cfg.sequence_parallel
    )
    return [embed, *blocks, head]


def untie_for_pipeline(blocks: list[nn.Module], mesh: ParallelMesh | None) -> nn.Parameter | None:
    """With pp > 1 the embedding (first stage) and a tied head (last stage) live on different
    ranks: give the head its own copy of the weight, marked and synced as tied. Returns the
    tied parameter this rank holds (None if it holds neither end). Checkpoints save and load
    the copy as the embedding itself ("0.tok.weight", block 0's name in
    ``stage_param_names``), so one tensor serves every pipeline layout."""

    head, embed = blocks[-1], blocks[0]
    weight = embed.tok.weight
    tied = head.weight is weight
    shared = getattr(head, "embedding", None) is weight  # multi-token prediction's lookups
    if not (tied or shared):
        return None
    if mesh is None or mesh.pp_size == 1:
        return None
    if mesh.is_last_stage:
        copy = nn.Parameter(weight.detach().clone())
        layout = param_layout(weight)
        mark_sharded(copy, layout.dim, layout.group, layout.full_size)
        mark_tied_copy(copy, "0.tok.weight")
        if tied:
            head.weight = copy
        if shared:
            head.embedding = copy
        return copy
    return weight if mesh.is_first_stage else None


def lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    cfg,
    mesh: ParallelMesh | LossGroups | None = None,
    *,
    weight: torch.Tensor | None = None,
    recompute: bool = False,
    inplace_backward: bool = False,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean vocab-parallel cross-entropy of logits [B·T, vocab / tp] against targets [B, T] over
    ``mesh``'s groups (or its ``loss_groups``, read once by a caller that loops) (``cfg.vocab_size``
    is the true vocabulary: padded columns are ignored; targets ``IGNORE_INDEX`` count for nothing).
    Under context parallelism the logits are this rank's chunks' (T/cp per row), the targets are
    split alike and the loss is normalised as docs/context.md ("The loss") says. ``weight`` given:
    ``logits`` are the head's hidden states [B·T, H] (``Head.return_hidden``) and the loss is the
    fused vocab-parallel linear cross-entropy against ``weight`` [vocab / tp, H] (chunks of logits
    only; ``recompute``: backward recomputes them, for schedules that hold many micro-batches'
    graphs, GPipe). ``inplace_backward``: the gradient overwrites the logits (a loop that never
    reads them again: ``fastpar.ops.cross_entropy``). ``reduction`` "sum": the sum over this rank's
    valid targets instead (its chunks' under context parallelism; no count, no all-reduce), for a
    caller that divides by the global batch's count (``PipelineEngine``'s "token" normalisation)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"lm_loss reduction must be 'mean' or 'sum', got {reduction!r}")
    tp_group, cp_group = loss_groups(mesh)
    targets = cp_split(targets, cp_group).reshape(-1)
    summed = reduction == "sum"
    reduction = "mean" if cp_group is None and not summed else "sum"
    options = dict(group=tp_group, vocab_size=cfg.vocab_size, reduction=reduction)
    if weight is not None:  # the head's region op already sums d hidden over TP
        loss = vocab_parallel_linear_cross_entropy(
            logits, weight, targets, reduce_hidden_grad=False, recompute=recompute, **options
        )
    else:
        loss = vocab_parallel_cross_entropy(
            logits, targets, inplace_backward=inplace_backward, **options
        )
    if cp_group is None or summed:
        return loss
    count = (targets != IGNORE_INDEX).sum().float()
    plain.all_reduce(count, group=cp_group)  # the whole sequence's tokens (no host sync)
    return loss * group_size(cp_group) / count.clamp(min=1)
