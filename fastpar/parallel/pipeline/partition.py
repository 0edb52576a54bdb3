"""Split a chain of blocks into contiguous pipeline stages of balanced cost."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def block_costs(blocks: Sequence[nn.Module]) -> list[float]:
    """Default cost of each block: its parameter count (at least 1, so empty blocks count)."""
    return [float(max(1, sum(p.numel() for p in b.parameters()))) for b in blocks]


def partition(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges [start, end) of blocks, one per stage, minimising the largest stage
    cost (dynamic programming over split points; ties keep earlier stages smaller)."""
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n < num_stages:
        raise ValueError(
            f"the model has {n} blocks but the pipeline has {num_stages} stages: every stage "
            f"needs at least one block; use pp <= {n} or split the model into more blocks"
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"block costs must be non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the smallest max-cost of putting blocks [0, i) on s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    ranges, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def build_stage(
    blocks: Sequence[nn.Module] | nn.Sequential,
    num_stages: int,
    stage: int,
    *,
    costs: Sequence[float] | None = None,
) -> tuple[nn.Sequential, tuple[int, int]]:
    """This stage's blocks as an ``nn.Sequential``, and their [start, end) range."""
    blocks = list(blocks)
    costs = block_costs(blocks) if costs is None else list(costs)
    if len(costs) != len(blocks):
        raise ValueError(f"got {len(costs)} costs for {len(blocks)} blocks")
    ranges = partition(costs, num_stages)
    start, end = ranges[stage]
    return nn.Sequential(*blocks[start:end]), (start, end)
