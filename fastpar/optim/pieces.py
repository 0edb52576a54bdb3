"""The checkpoint-pieces protocol (``checkpoint_pieces`` / ``load_checkpoint_pieces``), and its
implementation for a plain torch optimizer. It lives here, below ``fastpar.zero`` and
``fastpar.checkpoint``, which both use it (docs/layouts.md, "Checkpoint pieces")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch

SCALAR_KEYS = frozenset({"step"})
"""State keys that are one value per parameter (global shape [1]), not one per element."""

Piece = tuple[torch.nn.Parameter, str, torch.Tensor, int, int]
DEFAULT_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


@runtime_checkable
class KeyedLookup(Protocol):
    """``lookup(param, key)`` -> the whole LOCAL tensor of ``key`` for ``param``, or None; and
    ``lookup.keys(param)``: the keys saved for ``param``."""

    def __call__(self, param: torch.Tensor, key: str) -> torch.Tensor | None: ...

    def keys(self, param: torch.Tensor) -> list[str]: ...


@runtime_checkable
class CheckpointPieces(Protocol):
    """An optimizer (or wrapper) that saves and loads its own state as pieces (docs/layouts.md)."""

    def checkpoint_pieces(self) -> list[Piece]: ...

    def load_checkpoint_pieces(self, lookup: Callable) -> None: ...


@runtime_checkable
class ReplicatedPieces(Protocol):
    """A pieces provider that says whether its pieces are the same on every data-parallel
    replica (then DP rank 0 alone writes them)."""

    dp_replicated: bool


def state_pieces(
    param: torch.Tensor, state: Mapping, values_shape: torch.Size, sl: slice, start: int
) -> list[Piece]:
    """Pieces of one optimizer state entry: per-element tensors (shape ``values_shape``) cut to
    the flat slice ``sl`` (elements [start, start + len) of ``param``), and "step"."""
    out: list[Piece] = []
    stop = start + (sl.stop - sl.start)
    for key, v in state.items():
        if key in SCALAR_KEYS:
            t = v.detach() if torch.is_tensor(v) else torch.tensor(float(v))
            out.append((param, key, t.reshape(1), 0, 1))
        elif torch.is_tensor(v) and v.shape == values_shape:
            out.append((param, key, v.detach().reshape(-1)[sl], start, stop))
        else:
            shape = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
            raise ValueError(
                f"optimizer state {key!r} ({shape}) is neither per-element (shape "
                f"{tuple(values_shape)}) nor one of {sorted(SCALAR_KEYS)}: fastpar.checkpoint "
                f"cannot reshard it"
            )
    return out


def keys_for(lookup: Callable, param: torch.Tensor, existing: Mapping | None = None) -> list[str]:
    """The state keys to ask ``lookup`` for: ``lookup.keys(param)`` when provided, else the
    keys already in ``existing`` state, else the usual ones."""
    if isinstance(lookup, KeyedLookup):
        return [k for k in lookup.keys(param) if k != "param"]
    if existing:
        return list(existing)
    return list(DEFAULT_KEYS)


def _params(optimizer: torch.optim.Optimizer, model_of: Mapping[int, torch.Tensor] | None):
    """(optimizer param, the model parameter it stands for), each parameter once, in order."""
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for q in group["params"]:
            if id(q) not in seen:
                seen.add(id(q))
                yield q, model_of.get(id(q), q) if model_of else q


def torch_optimizer_pieces(
    optimizer: torch.optim.Optimizer, model_of: Mapping[int, torch.Tensor] | None = None
) -> list[Piece]:
    """``checkpoint_pieces`` of a torch optimizer; ``model_of`` maps id(optimizer param) to the
    model parameter it stands for (an fp32 master for an fp16 parameter), default itself."""
    out: list[Piece] = []
    for q, p in _params(optimizer, model_of):
        out.append((p, "param", q.detach().reshape(-1), 0, q.numel()))
        state = optimizer.state.get(q, {})
        out += state_pieces(p, state, q.shape, slice(0, q.numel()), 0)
    return out


def load_torch_optimizer_pieces(
    optimizer: torch.optim.Optimizer,
    lookup: Callable,
    model_of: Mapping[int, torch.Tensor] | None = None,
) -> None:
    """``load_checkpoint_pieces`` of a torch optimizer: copy "param" into its parameters and
    rebuild its state (through ``optimizer.load_state_dict``, which places each tensor as the
    optimizer wants it). Hyper-parameters (lr, ...) stay as they are. State is left untouched
    when the lookup has none (an import of weights only)."""
    param_groups = optimizer.state_dict()["param_groups"]
    state: dict[int, dict] = {}
    with torch.no_grad():
        for index, (q, p) in enumerate(_params(optimizer, model_of)):
            value = lookup(p, "param")
            if value is not None:
                q.copy_(value.reshape(q.shape))
            entry = {}
            for key in keys_for(lookup, p, optimizer.state.get(q)):
                t = lookup(p, key)
                if t is not None:
                    entry[key] = t.reshape(()) if key in SCALAR_KEYS else t.reshape(q.shape)
            if entry:
                state[index] = entry
    if state:
        optimizer.load_state_dict({"state": state, "param_groups": param_groups})
