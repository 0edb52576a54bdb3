"""Where each parameter lives: the marks fastpar puts on parameters (sharded, replicated, expert,
duplicated, tied copy), and the one rule that says over which groups a parameter is replicated,
so which rank holds its reference copy (docs/layouts.md, "Parameter marks")."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn

from fastpar.mesh.ranks import Group, group_rank

if TYPE_CHECKING:
    from fastpar.mesh.groups import ParallelMesh

_ATTR = "_fastpar_layout"
_DUPLICATED = "_fastpar_duplicated_over"
_EXPERT = "_fastpar_expert"
_TIED_NAME = "_fastpar_checkpoint_name"
_BLOCKS = "_fastpar_matrix_blocks"
_HEADS = "_fastpar_matrix_heads"


@dataclass(frozen=True)
class ParamLayout:
    """``kind`` "sharded": this rank holds a slice along ``dim`` of a tensor split over
    ``group``; "replicated": every rank of ``group`` holds the same tensor; "owned": this rank
    alone of ``group`` holds this whole tensor, under a name of its own (``mark_owned``).
    ``full_size`` is the unpadded size along ``dim`` of the whole tensor (sharded only)."""

    kind: Literal["sharded", "replicated", "owned"]
    group: dist.ProcessGroup | None
    dim: int | None = None
    full_size: int | None = None
    fused: int = 1
    """Sharded only: the dim holds ``fused`` stacked blocks (q|k|v) and each rank keeps its
    1/world of every block, so local row i is global row
    ``(i // per) * (full_size // fused) + rank * per + i % per`` with ``per`` rows per block."""


def mark_sharded(
    p: torch.nn.Parameter, dim: int, group: dist.ProcessGroup | None, full_size: int, fused: int = 1
) -> None:
    setattr(p, _ATTR, ParamLayout("sharded", group, dim, full_size, fused))
    _remember(p)


def mark_replicated(p: torch.nn.Parameter, group: dist.ProcessGroup | None) -> None:
    setattr(p, _ATTR, ParamLayout("replicated", group))


def mark_owned(p: torch.nn.Parameter, group: dist.ProcessGroup | None) -> None:
    """``p`` is whole and this rank alone of ``group`` holds it; the other ranks hold other
    tensors of the same list under their own names: a per-head module's parameter, kept by the
    rank that holds its head (``norms.2.weight`` on one TP rank, ``norms.0.weight`` on another).
    Not replicated over ``group``: its gradient counts and a checkpoint writes it on this rank."""
    setattr(p, _ATTR, ParamLayout("owned", group))


def param_layout(p: torch.Tensor) -> ParamLayout | None:
    """The mark of ``p``, or None for a parameter fastpar did not create (plain torch.nn)."""
    return getattr(p, _ATTR, None)


def mark_duplicated(p: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``p`` (whatever its TP layout) is held identically by every rank of ``group`` — e.g. a
    word embedding tied between the first and last pipeline stage (the mesh's embedding group)."""
    setattr(p, _DUPLICATED, (*getattr(p, _DUPLICATED, ()), group))


def duplicated_over(p: torch.Tensor) -> tuple:
    return getattr(p, _DUPLICATED, ())


@dataclass(frozen=True)
class ExpertLayout:
    """Dim 0 of an expert parameter indexes experts: this rank holds experts
    [rank · n, (rank + 1) · n) of ``num_experts``, split over ``group`` (the EP group; None
    when there is no expert parallelism)."""

    group: dist.ProcessGroup | None
    num_experts: int


def mark_expert(
    p: torch.Tensor, group: dist.ProcessGroup | None = None, num_experts: int | None = None
) -> None:
    """``p`` belongs to experts (dim 0 = local experts): replicated over the
    expert-data-parallel group, not the data-parallel group."""
    setattr(p, _EXPERT, ExpertLayout(group, num_experts if num_experts is not None else p.shape[0]))
    _remember(p)


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, _EXPERT, None) is not None


def expert_layout(p: torch.Tensor) -> ExpertLayout | None:
    return getattr(p, _EXPERT, None)


def mark_tied_copy(p: torch.Tensor, name: str) -> None:
    """``p`` is this rank's copy of the global tensor ``name`` (the last pipeline stage's copy
    of a word embedding tied to the LM head): checkpoints save and load it as ``name``, whatever
    name the caller lists it under, so one global tensor serves every pipeline layout."""
    setattr(p, _TIED_NAME, name)


def tied_name(p: torch.Tensor) -> str | None:
    """The global name ``mark_tied_copy`` gave ``p``, or None."""
    return getattr(p, _TIED_NAME, None)


@dataclass(frozen=True)
class MatrixBlocks:
    """The separate matrices one parameter stacks along ``dim`` of its whole (TP-assembled)
    tensor: ``repeat`` groups of blocks of ``sizes`` rows each; matrix j is block j of every
    group, concatenated (a Llama q|k|v grouped by key/value head: sizes (rep·d, d, d), repeat
    kv_heads; a gated expert's gate|up: sizes (F, F) along dim -1). Read by ``fastpar.optim.Muon``
    (docs/muon.md)."""

    dim: int
    sizes: tuple[int, ...]
    repeat: int = 1


def mark_blocks(p: torch.Tensor, dim: int, sizes: tuple[int, ...], repeat: int = 1) -> None:
    """``p`` stacks several matrices along ``dim`` (``MatrixBlocks``)."""
    setattr(p, _BLOCKS, MatrixBlocks(dim, tuple(int(s) for s in sizes), int(repeat)))


def matrix_blocks(p: torch.Tensor) -> MatrixBlocks | None:
    """The ``mark_blocks`` mark of ``p``, or None."""
    return getattr(p, _BLOCKS, None)


@dataclass(frozen=True)
class MatrixHeads:
    """Attention heads along ``dim`` of ``p``'s whole (TP-assembled) tensor: every ``size``
    consecutive rows (or columns) are one head's matrix (q|k|v by rows, the output projection
    by columns). ``fastpar.optim.Muon(per_head=True)`` orthogonalises each apart (docs/muon.md)."""

    dim: int
    size: int


def mark_heads(p: torch.Tensor, dim: int, head_size: int) -> None:
    """``p`` holds attention heads of ``head_size`` along ``dim`` (``MatrixHeads``)."""
    setattr(p, _HEADS, MatrixHeads(int(dim), int(head_size)))


def matrix_heads(p: torch.Tensor) -> MatrixHeads | None:
    """The ``mark_heads`` mark of ``p``, or None."""
    return getattr(p, _HEADS, None)


# -- who holds a copy -------------------------------------------------------------------------
def data_parallel_groups(
    mesh: ParallelMesh | None = None, group: Group = None
) -> tuple[Group, Group]:
    """(dense, expert): the groups data parallelism replicates dense and expert parameters
    over, and reduces their gradients over — the mesh's dp × cp group (context-parallel ranks
    hold the same weights; without context parallelism it is the dp group) and its expert-dp
    group, or ``group`` (None = the default group) for both without a mesh."""
    if mesh is not None:
        return getattr(mesh, "dp_cp_group", mesh.dp_group), mesh.expert_dp_group
    return group, group


def sharding_groups(
    mesh: ParallelMesh | None = None, group: Group = None
) -> tuple[list[Group], list[Group]]:
    """([dense, expert] groups ZeRO shards over, [dense, expert] groups of each shard's replicas
    or None): ``data_parallel_groups`` and no replicas, but under a mesh's hybrid sharding
    (dp_replicate > 1) the dp-shard × cp and expert-dp-shard groups, and the dp-replicate and
    expert-dp-replicate groups (every rank of one holds the same shards)."""
    layout = getattr(mesh, "layout", None)
    if layout is None or not getattr(layout, "hybrid", False):
        return list(data_parallel_groups(mesh, group)), [None, None]
    shards = [mesh.dp_shard_cp_group, mesh.expert_dp_shard_group]
    return shards, [mesh.dp_replicate_group, mesh.expert_dp_replicate_group]


def data_parallel_group(
    p: torch.Tensor, mesh: ParallelMesh | None = None, group: Group = None
) -> Group:
    """The group data parallelism replicates ``p`` over (``data_parallel_groups``)."""
    return data_parallel_groups(mesh, group)[is_expert(p)]


def replica_groups(
    p: torch.Tensor,
    mesh: ParallelMesh | None = None,
    *,
    group: Group = None,
    data_parallel: bool = True,
    duplicates: bool = True,
) -> list[Group]:
    """The groups over each of which every rank holds this very tensor ``p``: the TP group
    (``mesh.tp_group``, else ``group``) for an unmarked parameter, the mark's group for a
    replicated one (none for a sharded or owned one), each ``mark_duplicated`` group unless
    ``duplicates=False``, and, with a mesh and ``data_parallel``, ``data_parallel_group(p)``
    (pass ``data_parallel=False`` where the data is sharded over DP: ZeRO)."""
    layout = param_layout(p)
    groups: list[Group] = []
    if layout is None:
        groups.append(mesh.tp_group if mesh is not None else group)
    elif layout.kind == "replicated":
        groups.append(layout.group)
    if duplicates:
        groups += duplicated_over(p)
    if mesh is not None and data_parallel:
        groups.append(data_parallel_group(p, mesh))
    return groups


def holds_reference_copy(p: torch.Tensor, mesh: ParallelMesh | None = None, **kwargs) -> bool:
    """Whether this rank is rank 0 of every one of ``replica_groups(p, mesh, **kwargs)``: the
    one rank, among all that hold this data, that counts or writes it."""
    return all(group_rank(g) == 0 for g in replica_groups(p, mesh, **kwargs))


_MARKS = (_ATTR, _DUPLICATED, _EXPERT, _TIED_NAME, _BLOCKS, _HEADS)


def copy_marks(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Put every fastpar mark of ``src`` on ``dst`` (a wrapper's replacement of the same
    parameter, e.g. FSDP2's DTensor parameter); returns whether ``src`` carried any."""
    found = False
    for attr in _MARKS:
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))
            found = True
    _remember(dst)
    return found


# -- tracing a tensor back to its marked parameter ---------------------------------------------
_MARKED_SHARDS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""id → every live tensor with a sharded or expert mark, held weakly (an entry goes when its
tensor dies); keyed by id, since tensors compare elementwise."""


def _remember(p: torch.Tensor) -> None:
    layout = param_layout(p)
    if is_expert(p) or (layout is not None and layout.kind == "sharded"):
        _MARKED_SHARDS[id(p)] = p


def _memory_key(t: torch.Tensor) -> tuple | None:
    """(data pointer, shape, strides, dtype, device) of a plain strided tensor with data."""
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return None
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (fake tensors); a DTensor gives 0
        return None
    return (ptr, tuple(t.shape), t.stride(), t.dtype, t.device) if ptr else None


def marked_shard_index() -> dict[tuple, torch.Tensor]:
    """{memory key: tensor} of the live tensors with a sharded or expert mark, built now (a
    parameter may have been re-pointed into a flat ZeRO buffer since it was marked)."""
    index: dict[tuple, torch.Tensor] = {}
    for p in list(_MARKED_SHARDS.values()):
        key = _memory_key(p)
        if key is not None:
            index.setdefault(key, p)
    return index


def marked_shard_of(
    t: torch.Tensor, index: dict[tuple, torch.Tensor] | None = None
) -> torch.Tensor | None:
    """The live tensor with a sharded or expert mark whose memory ``t`` is exactly (same data
    pointer, shape, strides, dtype and device: the parameter, its ``.detach()`` or ``.data``),
    or None; a copy (``.clone()``) is not traced. ``index``: a ``marked_shard_index()`` to
    reuse over many look-ups."""
    key = _memory_key(t)
    if key is None:
        return None
    return (marked_shard_index() if index is None else index).get(key)


def restore_marks(marked: Mapping[str, torch.Tensor], module: nn.Module) -> int:
    """Put the fastpar marks of ``marked`` ({name: parameter}, taken before wrapping) on
    ``module``'s parameters of the same names; returns how many parameters carry marks.

    ``torch.distributed.fsdp.fully_shard`` replaces every parameter by a new DTensor
    parameter and drops fastpar's marks with the old object; without them the global grad
    norm (``fastpar.amp``) would take TP-sharded weights for replicated ones::

        before = dict(model.named_parameters())
        fully_shard(model, mesh=mesh.to_device_mesh()["dp"])
        fastpar.mesh.restore_marks(before, model)
    """
    now = dict(module.named_parameters())
    missing = sorted(set(marked) - set(now))
    if missing:
        raise KeyError(f"parameters {missing[:5]} are not in the module; pass its own names")
    return sum(copy_marks(marked[name], now[name]) for name in marked)
