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


class VirtualStages(nn.Module):
    """A rank's model chunks for an interleaved schedule: ``chunks[c]`` (an ``nn.Sequential``)
    is virtual stage ``c * p + rank``, blocks ``ranges[c]`` of the whole model. The blocks are
    registered under their number in the whole model ("7.attn.qkv.weight"), so
    ``stage_param_names(module, 0)`` and checkpoints see the whole model's names. The engine
    runs the chunks one by one; calling this module itself is an error."""

    def __init__(self, blocks: Sequence[nn.Module], ranges: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        self.ranges = [tuple(r) for r in ranges]
        for start, end in self.ranges:
            for k in range(start, end):
                self.add_module(str(k), blocks[k])
        # plain list: the blocks are registered once, above, under their global numbers
        self.chunks = [nn.Sequential(*blocks[s:e]) for s, e in self.ranges]

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a VirtualStages module holds non-contiguous model chunks: run it with "
            "PipelineEngine and an Interleaved schedule (each chunk is .chunks[c])"
        )


def build_virtual_stages(
    blocks: Sequence[nn.Module] | nn.Sequential,
    num_stages: int,
    stage: int,
    virtual_stages: int,
    *,
    costs: Sequence[float] | None = None,
) -> tuple[VirtualStages, list[tuple[int, int]]]:
    """This rank's ``virtual_stages`` chunks: the blocks cut into ``num_stages * virtual_stages``
    contiguous ranges of balanced cost, placed round-robin (rank r holds ranges r, r + p, ...
    — Megatron's placement: the first chunk of rank 0 starts the model, the last chunk of the
    last rank ends it). Returns the chunks and their [start, end) ranges."""
    blocks = list(blocks)
    costs = block_costs(blocks) if costs is None else list(costs)
    if len(costs) != len(blocks):
        raise ValueError(f"got {len(costs)} costs for {len(blocks)} blocks")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    total = num_stages * virtual_stages
    if len(blocks) < total:
        raise ValueError(
            f"the model has {len(blocks)} blocks but pp {num_stages} x {virtual_stages} virtual "
            f"stages needs {total} chunks of at least one block each; use fewer virtual stages "
            f"(at most {len(blocks) // num_stages}) or a model with more blocks"
        )
    ranges = partition(costs, total)
    mine = ranges[stage::num_stages]
    return VirtualStages(blocks, mine), mine
