"""How ``fastpar.optim.Muon`` gets each logical matrix whole (docs/muon.md): a tensor-parallel
shard all-gathered over its TP group into the whole tensor (fused q|k|v, gate|up reordered from
each rank's share of every block) and sliced back; a flat data-parallel shard (the ``Replicate``
/ ``Shard`` family's 1-D masters, which cut across parameters) all-gathered over its group,
each whole parameter (each expert of an expert stack) orthogonalised by one owner rank
(balanced by Newton–Schulz cost), and the results reduce-scattered back (a sum of one owner's
values and zeros: exact)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from fastpar.comm import plain
from fastpar.mesh.placement import is_expert, matrix_blocks, matrix_heads, param_layout
from fastpar.mesh.ranks import group_rank, group_size
from fastpar.reference.muon import Blocks, head_blocks

FLAT_ATTR = "_fastpar_flat"
"""Attribute of a flat master (``fastpar.parallel``'s ``FlatShard`` sets it): the flat it is
this rank's shard of (``params``, ``view``, ``mine``, ``padded``, ``sharded``, ``size``,
``rank``, ``group``)."""


def ring_bytes(numel: int, element_size: int, world: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of a buffer of ``numel``."""
    return (world - 1) / world * numel * element_size if world > 1 else 0.0


def blocks_of(p: torch.Tensor) -> Blocks | None:
    """The separate matrices of ``p``'s whole tensor: its ``mark_blocks`` mark, else the
    ``fused`` blocks of its sharded mark, else None (one matrix, or one per expert)."""
    b = matrix_blocks(p)
    if b is not None:
        return (b.dim, b.sizes, b.repeat)
    layout = param_layout(p)
    if layout is not None and layout.kind == "sharded" and layout.fused > 1:
        return (layout.dim, (layout.full_size // layout.fused,) * layout.fused, 1)
    return None


def _sharded(p: torch.Tensor, local: torch.Size):
    """(layout, world, rank) when ``p`` is split over a TP group of more than one rank, else
    None; refuses a padded split (its whole tensor is not the rows the ranks hold)."""
    layout = param_layout(p)
    if layout is None or layout.kind != "sharded":
        return None
    world = group_size(layout.group)
    if world == 1:
        return None
    if local[layout.dim] * world != layout.full_size:
        raise ValueError(
            f"Muon: a parameter of local shape {tuple(local)} split over {world} ranks along "
            f"dim {layout.dim} holds {local[layout.dim] * world} rows of {layout.full_size} "
            "(a padded split): give it to AdamW (muon_param_groups(..., is_matrix=...))"
        )
    return layout, world, group_rank(layout.group)


def assemble(update: torch.Tensor, p: torch.Tensor, counts: dict | None = None) -> torch.Tensor:
    """The whole tensor of ``update`` (this rank's shard of ``p``'s shape), all-gathered over
    ``p``'s TP group; ``update`` itself when ``p`` is not split."""
    split = _sharded(p, update.shape)
    if split is None:
        return update
    layout, world, _ = split
    u = update.contiguous()
    chunks = [torch.empty_like(u) for _ in range(world)]
    plain.all_gather(chunks, u, group=layout.group)
    if counts is not None:
        counts["tp_gather"] += ring_bytes(u.numel() * world, u.element_size(), world)
    if layout.fused == 1:
        return torch.cat(chunks, dim=layout.dim)
    per = u.shape[layout.dim] // layout.fused
    parts = [c.narrow(layout.dim, j * per, per) for j in range(layout.fused) for c in chunks]
    return torch.cat(parts, dim=layout.dim)


def local_part(full: torch.Tensor, p: torch.Tensor, local: torch.Size) -> torch.Tensor:
    """This rank's shard (shape ``local``) of the whole tensor ``full`` of ``p``."""
    split = _sharded(p, local)
    if split is None:
        return full
    layout, _, rank = split
    n = local[layout.dim]
    if layout.fused == 1:
        return full.narrow(layout.dim, rank * n, n)
    per, block = n // layout.fused, layout.full_size // layout.fused
    parts = [full.narrow(layout.dim, j * block + rank * per, per) for j in range(layout.fused)]
    return torch.cat(parts, dim=layout.dim)


Orthogonalize = Callable[[torch.Tensor, Blocks | None], torch.Tensor]


def whole_update(
    update: torch.Tensor,
    p: torch.Tensor,
    ortho: Orthogonalize,
    counts: dict | None = None,
    per_head: bool = False,
) -> torch.Tensor:
    """``ortho`` of the whole tensor of ``p`` (gathered), this rank's shard of the result;
    ``per_head``: each head of a ``mark_heads`` mark its own matrix, in whole-tensor rows."""
    full = assemble(update, p, counts)
    blocks = blocks_of(p)
    if per_head:
        blocks = head_blocks(blocks, matrix_heads(p), full.shape)
    return local_part(ortho(full, blocks), p, update.shape)


def ns_cost(p: torch.Tensor, local: torch.Size) -> float:
    """Newton–Schulz flops of ``p``'s whole tensor (∝ A·B·min(A, B) per matrix), to balance
    owner ranks."""
    split = _sharded(p, local)
    shape = list(local)
    if split is not None:
        shape[split[0].dim] = split[0].full_size
    if len(shape) < 2:
        return 0.0
    a, b = shape[-2], shape[-1]
    lead = 1
    for n in shape[:-2]:
        lead *= n
    return float(lead * a * b * min(a, b))


def owners(costs: list[float], size: int) -> list[int]:
    """One rank per parameter: the costliest first, each to the least-loaded rank (ties: the
    lowest rank); deterministic, the same on every rank."""
    load = [0.0] * size
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


Piece = tuple[int, int | None]
"""One owner's unit of a flat: (the parameter's index in the flat, an expert of its stack, or
None for the whole parameter)."""


def pieces(flat) -> list[tuple[Piece, float]]:
    """The flat's units of ownership with their ``ns_cost``: each expert of an expert stack
    apart (each is its own matrix), every other parameter whole."""
    out: list[tuple[Piece, float]] = []
    for i, (q, shape) in enumerate(zip(flat.params, flat.shapes, strict=True)):
        if is_expert(q) and len(shape) == 3 and shape[0] > 1:
            cost = ns_cost(q, shape) / shape[0]
            out += [((i, e), cost) for e in range(shape[0])]
        else:
            out.append(((i, None), ns_cost(q, shape)))
    return out


def flat_update(
    update: torch.Tensor,
    flat,
    ortho: Orthogonalize,
    counts: dict,
    owner: list[tuple[Piece, int]],
    per_head: bool = False,
) -> torch.Tensor:
    """The orthogonalised update of this rank's flat shard ``update`` [shard_len]: all-gather
    the shard into the whole flat, each owner orthogonalises its pieces (``owner``: each piece
    and its rank; TP-gathered among its TP peers, which own the same ones), reduce-scatter the
    sums back. A replicated (or one-rank) flat: every piece here, nothing sent."""
    gathered = flat.sharded and flat.size > 1
    full = update
    if gathered:
        full = torch.empty(flat.padded, dtype=update.dtype, device=update.device)
        _all_gather(full, update.contiguous(), flat)
        counts["dp_gather"] += ring_bytes(flat.padded, update.element_size(), flat.size)
    out = torch.zeros_like(full)
    for (i, e), rank in owner:
        if gathered and rank != flat.rank:
            continue
        u, o = flat.view(full, i), flat.view(out, i)
        if e is not None:
            u, o = u[e : e + 1], o[e : e + 1]
        o.copy_(whole_update(u, flat.params[i], ortho, counts, per_head))
    if not gathered:
        return out
    counts["dp_scatter"] += ring_bytes(flat.padded, out.element_size(), flat.size)
    return _reduce_scatter(out, flat)


def _all_gather(full: torch.Tensor, shard: torch.Tensor, flat) -> None:
    if dist.get_backend(flat.group) == "gloo":
        plain.all_gather(list(full.chunk(flat.size)), shard, group=flat.group)
    else:
        plain.all_gather_into_tensor(full, shard, group=flat.group)


def _reduce_scatter(full: torch.Tensor, flat) -> torch.Tensor:
    if dist.get_backend(flat.group) == "gloo":  # gloo: the sum everywhere, then this range
        plain.all_reduce(full, group=flat.group)
        return full[flat.mine]
    shard = torch.empty_like(full[flat.mine])
    plain.reduce_scatter_tensor(shard, full, group=flat.group)
    return shard
