"""All-to-all attention for context parallelism (DeepSpeed-Ulysses style, where the heads
divide cp): one all-to-all trades the sequence split for a head split, causal attention runs
locally on the whole sequence, a second all-to-all gives back this rank's tokens of every head.
The layout, the packed documents and the comparison with ring attention: docs/context.md
(``fastpar.parallel.context`` re-exports ``all_to_all_attention``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastpar.comm import all_to_all, group_size
from fastpar.comm.sequence import check_doc_ids, local_positions
from fastpar.ops.documents import document_attention


def _heads_to_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """[B, h, n, D] this rank's tokens of every head -> [B, h/cp, cp·n, D] every rank's
    tokens (source-rank major) of this rank's h/cp heads."""
    cp = group_size(group)
    b, h, n, d = x.shape
    parts = x.reshape(b, cp, h // cp, n, d).transpose(0, 1).contiguous()
    got = all_to_all(parts.reshape(cp * b, h // cp * n * d), group)
    return got.reshape(cp, b, h // cp, n, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def _ranks_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``_heads_to_ranks``."""
    cp = group_size(group)
    b, hl, total, d = x.shape
    n = total // cp
    parts = x.reshape(b, hl, cp, n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all(parts.reshape(cp * b, hl * n * d), group)
    return got.reshape(cp, b, hl, n, d).transpose(0, 1).reshape(b, cp * hl, n, d)


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    *,
    scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the sequence split on ``group`` by head-scattering all-to-alls
    (module docstring): q [B, Hq, 2c, D], k [B, Hkv, 2c, D], v [B, Hkv, 2c, Dv] (Dv may
    differ from D) -> [B, Hq, 2c, Dv]. ``scale`` (the softmax scale) defaults to 1/sqrt(D).
    ``doc_ids`` [B, S] (whole rows, as ``ring_attention``'s): attention stops at documents."""
    cp = group_size(group)
    if doc_ids is not None:
        doc_ids = check_doc_ids(doc_ids, q, cp, "all_to_all_attention")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % cp:
        raise ValueError(
            f"all-to-all attention splits the {hq} query heads of this rank over cp={cp}: they "
            f"must be divisible by {cp} (with TP, heads / tp); use ring attention"
        )
    if hkv % cp:  # repeat the K/V heads so each rank gets those of its query heads
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    n = q.shape[2]
    pos = torch.cat([local_positions(n * cp, cp, r, q.device) for r in range(cp)])
    order = torch.sort(pos).indices
    back = torch.argsort(order)
    qs, ks, vs = (_heads_to_ranks(t, group).index_select(2, order) for t in (q, k, v))
    rep = qs.shape[1] // ks.shape[1]
    if rep > 1:
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
    if doc_ids is None:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
    else:  # whole rows, in order: each rank's heads attend within their documents
        out = document_attention(qs, ks, vs, doc_ids, scale)
    return _ranks_to_heads(out.index_select(2, back), group)
