"""The load-balanced split of a sequence over context-parallel ranks (Megatron-Core's and
torchtitan's for causal attention): the sequence of length S is cut into 2·cp chunks of
c = S / (2·cp) tokens; cp rank i holds chunks i and 2·cp − 1 − i, in that order.
``fastpar.parallel.context`` (ring and all-to-all attention) builds on it; layers below it
(MoE statistics, the packed documents' masks) split their [B, S] inputs with it."""

from __future__ import annotations

import torch

from fastpar.comm.collectives import group_rank, group_size


def _chunks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions [2c] of the tokens cp rank ``rank`` holds (chunks i, 2cp−1−i)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism splits the sequence into 2*cp = {2 * cp} equal chunks: "
            f"seq_len {seq_len} is not divisible by {2 * cp}; use a multiple of {2 * cp}"
        )
    c = seq_len // (2 * cp)
    a, b = _chunks(cp, rank)
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
