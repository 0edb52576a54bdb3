"""The load-balanced split of a sequence over context-parallel ranks (Megatron-Core's and
torchtitan's for causal attention): the sequence of length S is cut into 2·cp chunks of
c = S / (2·cp) tokens; cp rank i holds chunks i and 2·cp − 1 − i, in that order.
``fastpar.parallel.context`` (ring and all-to-all attention) builds on it; layers below it
(MoE statistics, the packed documents' masks) split their [B, S] inputs with it."""

from __future__ import annotations

import torch

from fastpar.comm.collectives import group_rank, group_size


def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) cp rank ``rank`` holds, in its order."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions [2c] of the tokens cp rank ``rank`` holds (chunks i, 2cp−1−i)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism splits the sequence into 2*cp = {2 * cp} equal chunks: "
            f"seq_len {seq_len} is not divisible by {2 * cp}; use a multiple of {2 * cp}"
        )
    c = seq_len // (2 * cp)
    a, b = rank_chunks(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]).to(
        device
    )


def split_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of ``x`` (the whole sequence along ``dim``): chunks i and
    2cp − 1 − i, concatenated. A view-free gather; meant for ids, targets and positions
    (its gradient, if any, is scattered back into a zero tensor of the whole sequence)."""
    cp = group_size(group)
    if cp == 1:
        return x
    idx = local_positions(x.shape[dim], cp, group_rank(group), x.device)
    return x.index_select(dim, idx)


def check_doc_ids(doc_ids: torch.Tensor, q: torch.Tensor, cp: int, what: str) -> torch.Tensor:
    """``doc_ids`` [B, S] (the whole rows' document ids, S = cp · the n local tokens of q
    [B, H, n, D]) checked (integers, non-decreasing along each row) and moved to q's device;
    ``what`` names the caller in the errors."""
    b, n = q.shape[0], q.shape[2]
    if doc_ids.dim() != 2 or tuple(doc_ids.shape) != (b, n * cp):
        raise ValueError(
            f"{what}: doc_ids must be the whole rows' ids [B, S] = {(b, n * cp)} (S = cp · "
            f"{n} local tokens), got {tuple(doc_ids.shape)}"
        )
    if doc_ids.is_floating_point() or doc_ids.is_complex():
        raise ValueError(f"{what}: doc_ids must be integers, got {doc_ids.dtype}")
    if bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
        raise ValueError(f"{what}: doc_ids must be non-decreasing along each row")
    return doc_ids.to(q.device)
