"""Compact descriptions of which global elements a rank file holds (``compress`` / ``expand``),
kept in the metadata so a reader knows, before opening a file, whether it needs it and how much
of it (docs/checkpoints.md, "Inside fastpar.checkpoint")."""

from __future__ import annotations

import torch

Groups = list[list[int]]

PIECE_BYTES = 1 << 20
"""The largest piece saved as one record: the unit a reader reads and checks in part."""


def compress(runs: torch.Tensor) -> Groups:
    """[n, 2] runs -> groups [[start, length, count, stride]] covering the same runs."""
    groups: Groups = []
    for start, length in runs.tolist():
        if groups:
            g = groups[-1]
            if g[1] == length and g[2] == 1:
                g[2], g[3] = 2, start - g[0]
                continue
            if g[1] == length and start == g[0] + g[2] * g[3]:
                g[2] += 1
                continue
        groups.append([start, length, 1, 0])
    return groups


def expand(groups: Groups) -> torch.Tensor:
    """Groups -> [n, 2] int64 runs (the inverse of ``compress``)."""
    if not groups:
        return torch.zeros((0, 2), dtype=torch.int64)
    parts = []
    for start, length, count, stride in groups:
        starts = start + stride * torch.arange(count, dtype=torch.int64)
        parts.append(torch.stack([starts, torch.full_like(starts, length)], dim=1))
    return torch.cat(parts)


def merge(spans: dict, name: str, key: str, runs: torch.Tensor) -> None:
    """Add a piece's ``runs`` to ``spans`` ({name: {key: [groups of each piece]}})."""
    spans.setdefault(name, {}).setdefault(key, []).append(compress(runs))


def split(runs: torch.Tensor, values: torch.Tensor, max_bytes: int) -> list[tuple]:
    """A piece (``runs`` [n, 2], 1-D ``values``) as pieces of at most ``max_bytes`` of values
    each (a run cut where a piece ends), each a compact copy."""
    per = max(1, max_bytes // max(1, values.element_size()))
    n = values.numel()
    if n <= per:
        return [(runs, values)]
    starts, lengths = runs[:, 0], runs[:, 1]
    ends = torch.cumsum(lengths, 0)  # position in values where each run ends
    out = []
    for a in range(0, n, per):
        b = min(n, a + per)
        first = int(torch.searchsorted(ends, torch.tensor(a), right=True))
        last = int(torch.searchsorted(ends, torch.tensor(b - 1), right=True))
        sub_starts = starts[first : last + 1].clone()
        sub_lengths = lengths[first : last + 1].clone()
        begin = int(ends[first] - lengths[first])  # values position of run ``first``
        cut = a - begin
        sub_starts[0] += cut
        sub_lengths[0] -= cut
        sub_lengths[-1] -= int(ends[last]) - b
        out.append((torch.stack([sub_starts, sub_lengths], 1), values[a:b].clone()))
    return out


def wanted_pieces(pieces: list[Groups], want, missing: torch.Tensor) -> torch.Tensor:
    """Per piece (its groups), how many of its elements are wanted and still ``missing``."""
    runs = [expand(g) for g in pieces]
    counts = torch.tensor([len(r) for r in runs], dtype=torch.int64)
    if not int(counts.sum()):
        return torch.zeros(len(pieces), dtype=torch.int64)
    per_run = in_runs(torch.cat(runs), want, missing)
    piece = torch.repeat_interleave(torch.arange(len(pieces)), counts)
    return torch.zeros(len(pieces), dtype=torch.int64).index_add_(0, piece, per_run)


def piece_sizes(pieces: list[Groups]) -> list[int]:
    """Elements of each piece."""
    return [sum(length * count for _, length, count, _ in g) for g in pieces]


def in_runs(runs: torch.Tensor, want: torch.Tensor | None, missing: torch.Tensor) -> torch.Tensor:
    """Per run, how many of its elements are wanted and still ``missing``: ``want`` sorted
    global indices (None: all of them, ``missing`` then indexed by global index), ``missing``
    a bool mask over the positions of ``want``."""
    starts, ends = runs[:, 0].contiguous(), (runs[:, 0] + runs[:, 1]).contiguous()
    if want is not None:  # positions in ``want`` of the first wanted index >= each bound
        starts, ends = torch.searchsorted(want, starts), torch.searchsorted(want, ends)
    n = missing.numel()
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(missing.long(), 0)])
    return prefix[ends.clamp(0, n)] - prefix[starts.clamp(0, n)]
