"""``Lookup``: this rank's part of each saved tensor under the current layout, gathered from
the checkpoint in one pass (``CheckpointReader.gather``); what ``load`` hands the optimizer."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fastpar.checkpoint.reader import CheckpointReader
from fastpar.checkpoint.state import SCALAR_KEYS, global_index


def value_key(keys) -> str:
    """The key of a parameter's fp32 value: the optimizer's master if saved, else the model's."""
    return "param" if "param" in keys else "model"


def _covers(idx: torch.Tensor, gidx: torch.Tensor) -> bool:
    """Whether the sorted ``idx`` holds every non-padding index of ``gidx``."""
    want = gidx[gidx >= 0]
    if not want.numel():
        return True
    if not idx.numel():
        return False
    pos = torch.searchsorted(idx, want).clamp(max=idx.numel() - 1)
    return bool((idx[pos] == want).all())


class Lookup:
    """``lookup(param, key)``: the whole LOCAL tensor of ``param`` for ``key`` under the
    current layout (None if not saved); "param" is the fp32 value; "step" has shape [1].
    ``keys(param)``: the keys saved for it.

    Only this rank's elements are built: ``prepare`` gathers, for each (name, key), the global
    indices its parameters hold, in one pass over the rank files that hold them
    (``CheckpointReader.gather``, files visited from ``prefer``'s own); anything not prepared
    is gathered when first asked for."""

    def __init__(
        self, reader: CheckpointReader, names: Mapping[int, str], prefer: int | None = None
    ) -> None:
        self.reader, self.names, self.prefer = reader, names, prefer
        self._index: dict[int, torch.Tensor] = {}
        self._got: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def global_index(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s flat global indices (-1 for padding), computed once per parameter."""
        if id(p) not in self._index:
            self._index[id(p)] = global_index(p).reshape(-1)
        return self._index[id(p)]

    def prepare(self, wants: Mapping[tuple[str, str], list[torch.Tensor]]) -> None:
        """Gather the elements of each (name, key) that its listed parameters hold."""
        request = {}
        for (name, key), params in wants.items():
            if key in SCALAR_KEYS:
                request[name, key] = torch.zeros(1, dtype=torch.int64)
                continue
            parts = [self.global_index(p) for p in params]
            if (name, key) in self._got:
                parts.append(self._got[name, key][0])
            request[name, key] = torch.unique(torch.cat([g[g >= 0] for g in parts]))
        got = self.reader.gather(request, prefer=self.prefer)
        for k, idx in request.items():
            self._got[k] = (idx, got[k])

    def local(self, name: str, key: str, p: torch.Tensor) -> torch.Tensor:
        """``p``'s part of ``key`` of the global tensor ``name``, laid out like ``p`` (padding
        zero; [1] for a scalar key), in the saved dtype."""
        got = self._got.get((name, key))
        if key in SCALAR_KEYS:
            if got is None:
                self.prepare({(name, key): [p]})
            return self._got[name, key][1].reshape(1).clone()
        gidx = self.global_index(p)
        if got is None or not _covers(got[0], gidx):
            self.prepare({(name, key): [p]})
        idx, values = self._got[name, key]
        pos = torch.searchsorted(idx, gidx.clamp(min=0)).clamp(max=max(idx.numel() - 1, 0))
        return values[pos].masked_fill(gidx < 0, 0).view(p.shape)

    def __call__(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        name = self.names.get(id(param))
        if name is None:
            return None
        keys = self.reader.tensors[name]["keys"]
        if key == "param":
            return self.local(name, value_key(keys), param).float()
        if key == "model" or key not in keys:
            return None
        return self.local(name, key, param)

    def keys(self, param: torch.Tensor) -> list[str]:
        name = self.names.get(id(param))
        if name is None:
            return []
        return ["param"] + [k for k in self.reader.tensors[name]["keys"] if k not in ("model",)]


def load_wants(reader: CheckpointReader, pairs, with_optimizer: bool) -> dict:
    """{(name, key): [parameters]} a load reads: each tensor's model value, and with an
    optimizer every saved key (the optimizer asks for them all)."""
    wants: dict[tuple[str, str], list[torch.Tensor]] = {}
    for name, p in pairs:  # the model's values first: the order load uses them in
        keys = reader.tensors[name]["keys"]
        wants.setdefault((name, "model" if "model" in keys else value_key(keys)), []).append(p)
    for name, p in pairs if with_optimizer else ():
        keys = reader.tensors[name]["keys"]
        for key in dict.fromkeys([value_key(keys), *(k for k in keys if k != "model")]):
            if all(q is not p for q in wants.setdefault((name, key), [])):
                wants[name, key].append(p)
    return wants
