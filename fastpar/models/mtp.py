"""Multi-token prediction (MTP) as DeepSeek-V3 defines it: D sequential modules after the main
model, module k predicting the token k + 1 positions ahead, sharing the model's embedding and
output head. What a module computes, which positions are targets, the loss and a forward of
your own (``tokens(ids)``, ``mtp_loss``): docs/mtp.md."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.comm import copy_to_region, group_size, scatter_to_sequence
from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.models.common import (
    IGNORE_INDEX,
    Embedding,
    Head,
    LossGroups,
    Norm,
    cp_split,
    lm_loss,
    loss_groups,
)
from fastpar.models.documents import current as current_documents
from fastpar.nn.embedding import vocab_parallel_lookup

__all__ = [
    "MTPHead",
    "MTPLayer",
    "MTPOutput",
    "add_mtp",
    "check_mtp",
    "current_tokens",
    "depth_targets",
    "mtp_loss",
    "tokens",
]

#: default --mtp-loss-coef: Megatron-LM's default and DeepSeek-V3's value for its last 4.8T
#: tokens (0.3 before)
DEFAULT_COEF = 0.1

#: the token ids of the running forward (a module global like the documents' context)
_TOKENS: list = [None]


@contextlib.contextmanager
def tokens(ids: torch.Tensor | None):
    """Run the enclosed forwards with these token ids [B, T] (whole rows, as the first block
    takes them): the MTP modules look up the tokens k positions ahead in them on whatever
    pipeline stage they run (nothing extra travels between stages)."""
    before, _TOKENS[0] = _TOKENS[0], ids
    try:
        yield ids
    finally:
        _TOKENS[0] = before


def current_tokens() -> torch.Tensor | None:
    """The ids of the running forward (``tokens``), or None."""
    return _TOKENS[0]


class MTPOutput(NamedTuple):
    """What an ``MTPHead`` returns in training mode: the main logits [B·T, vocab / tp] (or
    hidden states, ``return_hidden``), one such tensor per depth, and ``keep`` [D, B, T] bool
    (whole rows: position i and i + k lie in one packed document) or None (no documents)."""

    main: torch.Tensor
    depths: tuple
    keep: torch.Tensor | None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MTPOutput:
        """``fn`` applied to the main and every depth's tensor (``keep`` as it is)."""
        return MTPOutput(fn(self.main), tuple(fn(d) for d in self.depths), self.keep)


def document_keep(doc_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """[D, B, T] bool: position i and i + k (k = 1..D) lie in one document of the row."""
    b, t = doc_ids.shape
    keep = torch.zeros((depth, b, t), dtype=torch.bool, device=doc_ids.device)
    for k in range(1, depth + 1):
        keep[k - 1, :, : t - k] = doc_ids[:, : t - k] == doc_ids[:, k:]
    return keep


def depth_targets(targets: torch.Tensor, k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The depth-k targets [B, T] of the main targets [B, T] (whole rows): position i predicts
    the main target of i + k (t_{i+k+1}); ``IGNORE_INDEX`` past the row's end, where that
    target is ignored, and where ``keep`` [B, T] (``document_keep``) is False."""
    out = torch.full_like(targets, IGNORE_INDEX)
    out[:, : targets.shape[1] - k] = targets[:, k:]
    if keep is not None:
        out = out.masked_fill(~keep.to(out.device), IGNORE_INDEX)
    return out


class Projection(nn.Module):
    """``eh_proj``: [..., 2H] -> [..., H], no bias, replicated on every TP rank (its input is
    whole on each; under sequence parallelism each rank holds other tokens, so its weight
    gradient is a partial sum, all-reduced over ``group`` in backward like a ``Norm``'s)."""

    def __init__(self, in_features: int, out_features: int, group, partial_grad: bool):
        super().__init__()
        master = nn.Linear(in_features, out_features, bias=False)  # nn.Linear's init
        self.weight = nn.Parameter(master.weight.detach())
        self.group, self.partial_grad = group, partial_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_region(self.weight, self.group) if self.partial_grad else self.weight
        return F.linear(x, w)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]}, partial={self.partial_grad}"


class MTPLayer(nn.Module):
    """MTP module ``k``: ``block(eh_proj([enorm(e); hnorm(h)]))`` with [B, T(/tp), H] inputs
    and output, and ``norm``, the final norm its logits go through (HF's
    ``shared_head.norm``). Drawn in this order: enorm, hnorm, eh_proj, block, norm."""

    def __init__(self, cfg, k: int, mesh: ParallelMesh | None, block: Callable, norm: dict):
        super().__init__()
        group = as_group(mesh)
        sp = cfg.sequence_parallel and group_size(group) > 1
        kw = dict(**norm, group=group, partial_grad=sp)
        self.enorm, self.hnorm = Norm(cfg.hidden, **kw), Norm(cfg.hidden, **kw)
        self.eh_proj = Projection(2 * cfg.hidden, cfg.hidden, group, sp)
        self.block = block(cfg, cfg.layers + k - 1, mesh)
        self.norm = Norm(cfg.hidden, **kw)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.block(self.eh_proj(torch.cat((self.enorm(e), self.hnorm(h)), dim=-1)))


class MTPHead(Head):
    """The model's ``Head`` (its final norm and output weight, under the same names) followed
    by the MTP modules ``mtp`` [B, T(/tp), H] -> logits. ``embedding``: the model's token
    embedding (the same parameter; at pp > 1 the last stage's copy, summed with the first
    stage's like a tied head, ``untie_for_pipeline``). In training mode the ids come from
    ``tokens`` and it returns an ``MTPOutput``; in eval mode only the main logits, as a
    ``Head`` does (the validation loss is the main model's)."""

    def __init__(self, head: Head, embed: Embedding, layers: Sequence[MTPLayer]):
        nn.Module.__init__(self)
        self.group, self.sp, self.return_hidden = head.group, head.sp, head.return_hidden
        self.norm, self.weight = head.norm, head.weight
        self.embedding = embed.tok.weight
        self.shard, self.cp_group = embed.tok.shard, embed.cp_group
        self.mtp = nn.ModuleList(layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows of ids [B, T] -> this rank's embeddings [B, T(/cp)(/tp), H], as the
        model's ``Embedding`` places its own."""
        x = vocab_parallel_lookup(
            cp_split(ids, self.cp_group), self.embedding, self.shard, self.group
        )
        return scatter_to_sequence(x, self.group, dim=1) if self.sp else x

    def forward(self, h: torch.Tensor) -> torch.Tensor | MTPOutput:
        main = self.project(self.norm(h))
        if not self.training:
            return main
        ids = current_tokens()
        if ids is None:
            raise RuntimeError(
                "multi-token prediction looks up the tokens ahead: run the model's training "
                "forward inside fastpar.models.mtp.tokens(ids) (the ids the first block takes)"
            )
        if ids.dim() != 2 or ids.shape[0] != h.shape[0]:
            raise ValueError(
                f"tokens(ids) holds {tuple(ids.shape)} but the head runs a batch of "
                f"{h.shape[0]} rows: pass this forward's ids [batch, seq]"
            )
        ids = ids.to(h.device)
        depths = []
        for k, layer in enumerate(self.mtp, 1):
            shifted = torch.zeros_like(ids)  # column i: ids[:, i + k]; the last k: no target, 0
            shifted[:, : ids.shape[1] - k] = ids[:, k:]
            h = layer(h, self.embed(shifted))
            depths.append(self.project(layer.norm(h)))
        docs = current_documents()
        keep = None if docs is None else document_keep(docs.ids.to(h.device), len(self.mtp))
        return MTPOutput(main, tuple(depths), keep)


def add_mtp(
    blocks: list[nn.Module], cfg, mesh: ParallelMesh | None, block: Callable
) -> list[nn.Module]:
    """``blocks`` ([Embedding, ..., Head]) with the head replaced by an ``MTPHead`` of
    ``cfg.mtp_depth`` modules whose blocks ``block(cfg, layer, mesh)`` builds (drawn after
    every other weight: the main model is the same with MTP on or off). Depth 0: unchanged."""
    depth = getattr(cfg, "mtp_depth", 0)
    if not depth:
        return blocks
    head, embed = blocks[-1], blocks[0]
    norm = {"kind": head.norm.kind, "eps": head.norm.eps}
    layers = [MTPLayer(cfg, k, mesh, block, norm) for k in range(1, depth + 1)]
    return [*blocks[:-1], MTPHead(head, embed, layers)]


def check_mtp(cfg) -> None:
    """``cfg.mtp_depth`` / ``cfg.mtp_loss_coef``: ValueError naming the value and the fix."""
    depth, coef = cfg.mtp_depth, cfg.mtp_loss_coef
    if not isinstance(depth, int) or depth < 0:
        raise ValueError(f"mtp_depth (--mtp-depth) must be an integer >= 0 (0: off), got {depth}")
    if depth >= cfg.seq_len:
        raise ValueError(
            f"mtp_depth (--mtp-depth) {depth} must be below seq_len {cfg.seq_len}: module k "
            f"predicts the token k + 1 ahead, so depth {depth} has no target in a row of "
            f"{cfg.seq_len}; use a depth <= {cfg.seq_len - 1}"
        )
    if not math.isfinite(coef) or coef < 0:
        raise ValueError(f"mtp_loss_coef (--mtp-loss-coef) {coef} must be a finite number >= 0")
    if not depth and coef != DEFAULT_COEF:
        raise ValueError(
            f"mtp_loss_coef (--mtp-loss-coef) {coef} has no effect without MTP modules: set "
            "mtp_depth (--mtp-depth D, e.g. 1) or drop it"
        )


def mtp_loss(
    out: torch.Tensor | MTPOutput,
    targets: torch.Tensor,
    cfg,
    mesh: ParallelMesh | LossGroups | None = None,
    *,
    weight: torch.Tensor | None = None,
    recompute: bool = False,
    inplace_backward: bool = False,
    reduction: str = "mean",
    parts: list | None = None,
) -> torch.Tensor:
    """``lm_loss`` of a model's output (the same call when ``out`` is a tensor: MTP off, or
    eval mode), else ``main + mtp_loss_coef / D · Σ_k CE_k`` over the ``depth_targets`` of
    ``targets`` [B, T]: "sum" the sums, "mean" divided by the count of valid main targets
    (under context parallelism this rank's chunks × cp / the whole rows' count, like
    ``lm_loss``; at least 1). Keyword arguments as ``lm_loss``'s, for every depth.
    ``parts``: a list that receives the MTP loss without its coefficient, (1 / D) Σ_k CE_k in
    the same reduction, detached (for the metrics' ``mtp_loss``)."""
    kw = dict(weight=weight, recompute=recompute, inplace_backward=inplace_backward)
    if not isinstance(out, MTPOutput):
        return lm_loss(out, targets, cfg, mesh, reduction=reduction, **kw)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"mtp_loss reduction must be 'mean' or 'sum', got {reduction!r}")
    groups = loss_groups(mesh)  # once, for every depth
    main = lm_loss(out.main, targets, cfg, groups, reduction="sum", **kw)
    terms = []
    for k, logits in enumerate(out.depths, 1):
        keep = None if out.keep is None else out.keep[k - 1]
        terms.append(
            lm_loss(logits, depth_targets(targets, k, keep), cfg, groups, reduction="sum", **kw)
        )
    depths = torch.stack(terms).sum() / len(terms)
    if reduction == "mean":
        cp = 1 if groups.cp is None else group_size(groups.cp)  # (whole rows: no all-reduce)
        scale = cp / (targets != IGNORE_INDEX).sum().float().clamp(min=1)
        main, depths = main * scale, depths * scale
    if parts is not None and torch.is_grad_enabled():  # once a micro-batch (not a no_grad
        parts.append(depths.detach())  # first forward under recompute)
    return main + cfg.mtp_loss_coef * depths
