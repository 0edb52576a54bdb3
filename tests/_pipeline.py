"""The plain pipeline models of the pipeline tests and their unpipelined references: ``blocks``
(an embedding, MLP blocks — optionally split over TP — and a head), ``tuple_blocks`` (stages that
pass tuples of tensors of several dtypes), ``batch`` / ``loss_fn``; ``dense_references`` (the
unpipelined model trained three ways, ``fastpar.tolerance``) and ``check_step`` (a step's loss
and every gradient against them, named by ``dense_name``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from _training import check, references
from torch import nn

from fastpar import tolerance
from fastpar.nn import ColumnParallelLinear, RowParallelLinear

V, H, T = 50, 16, 5


class Block(nn.Module):
    def __init__(self, h: int = H, dropout: float = 0.0, tp_mesh=None):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        if tp_mesh is None:
            self.fc, self.proj = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        else:
            self.fc = ColumnParallelLinear(h, 2 * h, mesh=tp_mesh)
            self.proj = RowParallelLinear(2 * h, h, mesh=tp_mesh)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.proj(F.gelu(self.fc(self.norm(x)))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(H), nn.Linear(H, V)

    def forward(self, x):
        return self.out(self.norm(x)).flatten(0, 1)


def blocks(n: int = 6, dropout: float = 0.0, tp_mesh=None) -> list[nn.Module]:
    torch.manual_seed(0)
    return (
        [nn.Embedding(V, H)]
        + [Block(dropout=dropout, tp_mesh=tp_mesh) for _ in range(n)]
        + [Head()]
    )


def loss_fn(logits, target):
    return F.cross_entropy(logits, target.flatten())


def batch(step: int, size: int = 24):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (size, T), generator=g), torch.randint(0, V, (size, T), generator=g)


# -- the unpipelined references (fastpar.tolerance) ------------------------------------------
@functools.cache
def dense_references(
    make: Callable[[], list[nn.Module]] = blocks,
    steps: int = 2,
    size: int = 24,
    *,
    lr: float = 0.5,
    data: Callable | None = None,
    loss: Callable = loss_fn,
    length: int | None = None,
) -> tolerance.References:
    """``steps`` SGD steps (``lr``) of the unpipelined ``nn.Sequential(*make())`` on
    ``data(step)`` (default ``batch(step, size)``: ids, so any dtype), three ways: fp32, its
    twin, float64. ``length`` (the longest reduction) defaults to the batch's tokens, the
    vocabulary or the widest layer, whichever is longest. Cached: pure in its arguments (ranks
    receive a forked copy, free to set its ``local``)."""
    data = data or (lambda step: batch(step, size))

    def run_loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
        x, y = data(step)
        cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
        x = tuple(map(cast, x)) if isinstance(x, tuple) else cast(x)
        return loss(model(x), cast(y))

    if length is None:
        widest = max(max(p.shape) for m in make() for p in m.parameters())
        length = max(size * T, widest)
    return references(
        lambda: nn.Sequential(*make()),
        run_loss,
        steps,
        lambda model: torch.optim.SGD(model.parameters(), lr=lr),
        length=length,
    )


def dense_name(name: str, lo: int) -> str:
    """The unpipelined model's name of a stage's parameter ``name`` (the stage holds blocks
    ``lo``, ``lo + 1``, ... as its children 0, 1, ...)."""
    k, _, rest = name.partition(".")
    return f"{int(k) + lo}.{rest}"


def check_step(
    refs: tolerance.References,
    step: int,
    loss,
    grads: Iterable[tuple[str, torch.Tensor | None]],
    where: str = "",
) -> None:
    """Step ``step``'s loss and every gradient (``(unpipelined name, grad)``, sliced like the
    caller's parameter by ``refs.local``) against the references."""
    comparisons = [] if loss is None else [refs.loss(step, loss)]
    for name, g in grads:
        assert g is not None, f"{where}{name}: no gradient at step {step + 1}"
        comparisons.append(refs.grad(step, name, g))
    check(comparisons, where)


# -- multi-tensor stage messages ------------------------------------------------------------
class TupleEmbed(nn.Module):
    """ids -> (hidden, side, positions int64, keep bool, scale float without grad, None)."""

    def __init__(self):
        super().__init__()
        self.tok, self.side = nn.Embedding(V, H), nn.Embedding(V, H)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        scale = (1.0 + ids[:, :1, None].float() / V).detach()  # [B, 1, 1], requires no grad
        return (self.tok(ids), self.side(ids), pos, ids % 3 != 0, scale, None)


class TupleBlock(nn.Module):
    """Uses every slot; updates hidden, passes side (a slot requiring grad) on unchanged."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.inner, self.pos = Block(dropout=dropout), nn.Embedding(T + 3, H)

    def forward(self, msg):
        h, side, pos, keep, scale, none = msg
        assert none is None and pos.dtype == torch.int64 and keep.dtype == torch.bool
        h = self.inner(h + self.pos(pos)) * scale + side * keep.unsqueeze(-1)
        return (h, side, pos, keep, scale, none)


class TupleHead(Head):
    def forward(self, msg):
        return super().forward(msg[0] + msg[1])


def tuple_blocks(n: int = 4, dropout: float = 0.0) -> list[nn.Module]:
    torch.manual_seed(0)
    return [TupleEmbed()] + [TupleBlock(dropout) for _ in range(n)] + [TupleHead()]
