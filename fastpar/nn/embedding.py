"""``VocabParallelEmbedding``: the embedding table split by vocabulary rows over the TP group."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar import debug
from fastpar.comm import group_rank, group_size, reduce_from_region
from fastpar.comm.checks import check_same, digest
from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_sharded


@dataclass(frozen=True)
class VocabShard:
    """Rank ``rank`` of ``world`` owns global ids [start, start + per_rank); ids >= ``vocab_size``
    are padding (the vocabulary is padded to ``per_rank * world``)."""

    vocab_size: int
    world: int
    rank: int

    @property
    def per_rank(self) -> int:
        return math.ceil(self.vocab_size / self.world)

    @property
    def start(self) -> int:
        return self.rank * self.per_rank

    @property
    def valid(self) -> int:
        """How many of this rank's rows are real vocabulary (the rest is padding)."""
        return max(0, min(self.per_rank, self.vocab_size - self.start))


def check_ids(ids: torch.Tensor, num_embeddings: int, what: str = "token id") -> None:
    """Raise if any id is outside [0, num_embeddings).

    Costs one min/max reduction over ``ids``; on CUDA the check is asynchronous (no host sync:
    a bad id fails the next synchronising call with this message).
    """
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{what}s must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return
    ok = (ids.min() >= 0) & (ids.max() < num_embeddings)
    torch._assert_async(
        ok,
        f"{what} out of range: every id must be in [0, {num_embeddings}); check the tokenizer's "
        f"vocabulary size against num_embeddings",
    )


def is_scaled_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's scaled word embedding (Gemma 3, BART, ...): an
    ``nn.Embedding`` subclass whose forward is the lookup times its ``embed_scale`` (a feature
    probe; parallelize's probe check compares the result with the unsplit module's)."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).__name__.endswith("ScaledWordEmbedding")
        and isinstance(getattr(module, "embed_scale", None), (torch.Tensor, float, int))
    )


def vocab_parallel_lookup(
    ids: torch.Tensor,
    weight: torch.Tensor,
    shard: VocabShard,
    group: dist.ProcessGroup | None,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """``VocabParallelEmbedding``'s lookup of ids [...] in this rank's rows ``weight``
    [per_rank, dim] (``shard``): [..., dim], identical on every rank of ``group`` (one
    all-reduce; none in backward). For a module that shares another's table (multi-token
    prediction's lookups in the model's embedding); no id check."""
    s = shard
    if s.world == 1:
        return F.embedding(ids, weight, padding_idx)
    outside = (ids < s.start) | (ids >= s.start + s.valid)
    local_ids = (ids - s.start).masked_fill(outside, 0)
    pad = padding_idx
    local_pad = pad - s.start if pad is not None and s.start <= pad < s.start + s.valid else None
    out = F.embedding(local_ids, weight, local_pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_region(out, group)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary split into contiguous ranges over the TP group.

    Shapes: ids [...] (global ids) → [..., embedding_dim], identical on every rank of ``group``.
    Communication: one all-reduce of the output over ``group`` (ids outside this rank's range
    are masked and their rows zeroed before it); none in backward.

    A vocabulary not divisible by the group size is padded to ``per_rank * tp`` rows; padded rows
    are zero and never looked up. ``check_ids=True`` (default) raises for ids < 0 or
    >= num_embeddings at the cost of one min/max reduction per call (asynchronous on CUDA);
    pass ``check_ids=False`` to skip it.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        check_ids: bool = True,
        group: dist.ProcessGroup | None = None,
        mesh: ParallelMesh | DeviceMesh | None = None,
        device=None,
        dtype=None,
        _master: nn.Embedding | None = None,
    ) -> None:
        super().__init__()
        self.group = as_group(mesh, "tp", group)
        self.shard = VocabShard(num_embeddings, group_size(self.group), group_rank(self.group))
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.check_ids = padding_idx, check_ids
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx {padding_idx} is outside [0, {num_embeddings})")
        if padding_idx is not None and padding_idx < 0:
            self.padding_idx = padding_idx + num_embeddings
        master = _master or nn.Embedding(
            num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype
        )
        s = self.shard
        with torch.no_grad():
            local = master.weight.new_zeros((s.per_rank, embedding_dim))
            local[: s.valid] = master.weight[s.start : s.start + s.valid]
        self.weight = nn.Parameter(local)
        mark_sharded(self.weight, 0, self.group, num_embeddings)
        self.register_buffer("embed_scale", None, persistent=False)  # (a scaled embedding's)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, **kwargs) -> VocabParallelEmbedding:
        """Shard an existing ``nn.Embedding`` (every rank must pass the same weights). A scaled
        embedding (``is_scaled_embedding``: Gemma's, BART's) keeps its scale, applied after the
        lookup in the weight's dtype as Hugging Face does."""
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports neither max_norm nor sparse")
        out = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            _master=embedding,
            **kwargs,
        )
        if is_scaled_embedding(embedding):
            scale = torch.as_tensor(embedding.embed_scale).detach().clone()
            out.embed_scale = scale.to(embedding.weight.device)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.check_ids:
            check_ids(ids, self.num_embeddings)
        s = self.shard
        if s.world > 1 and debug.enabled():  # see fastpar.debug: one small all-gather
            check_same(
                f"VocabParallelEmbedding({self.num_embeddings}, {self.embedding_dim})",
                {"ids shape": tuple(ids.shape), "ids": digest(ids)},
                self.group,
                ids.device,
                "every rank of a tensor-parallel group must look up the same token ids",
            )
        out = vocab_parallel_lookup(ids, self.weight, s, self.group, self.padding_idx)
        scale = self.embed_scale
        return out if scale is None else out * scale.to(self.weight.dtype)

    def extra_repr(self) -> str:
        s = self.shard
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{s.start}, {s.start + s.valid}) "
            f"of {s.per_rank * s.world} (padded), padding_idx={self.padding_idx}"
        )
