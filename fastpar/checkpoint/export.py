"""One plain torch state_dict from a sharded checkpoint, and back into any layout."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from fastpar.checkpoint.core import load_optimizer
from fastpar.checkpoint.format import CheckpointError, atomic_torch_save
from fastpar.checkpoint.reader import CheckpointReader
from fastpar.checkpoint.state import global_names, global_shape, localize


def export_state_dict(
    path_or_checkpoint: str | os.PathLike | CheckpointReader,
    out_file: str | os.PathLike | None = None,
) -> dict[str, torch.Tensor]:
    """{global name: full fp32 tensor} of every parameter in the checkpoint (the fp32 master
    where one was saved; padding dropped, fused blocks in their global order). Written to
    ``out_file`` atomically (``torch.save``) when given. Runs in one process, no collective."""
    reader = (
        path_or_checkpoint
        if isinstance(path_or_checkpoint, CheckpointReader)
        else CheckpointReader(os.fspath(path_or_checkpoint))
    )
    state = {name: reader.value(name).clone() for name in reader.tensors}
    reader.release()
    if out_file is not None:
        atomic_torch_save(state, os.path.abspath(os.fspath(out_file)))
    return state


class _WeightsLookup:
    """A lookup over a full state_dict: "param" only (optimizer state stays as it is)."""

    def __init__(self, state: Mapping[str, torch.Tensor], names: Mapping[int, str]) -> None:
        self.state, self.names = state, names

    def __call__(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        name = self.names.get(id(param))
        if key != "param" or name is None:
            return None
        return localize(self.state[name].float(), param)

    def keys(self, param: torch.Tensor) -> list[str]:
        return ["param"] if id(param) in self.names else []


def import_state_dict(
    file_or_state: str | os.PathLike | Mapping[str, torch.Tensor],
    model_params: Mapping[str, torch.Tensor],
    optimizer: Any = None,
) -> None:
    """Load a full state_dict ({global name: tensor}, a file or a dict) into this rank's
    ``model_params`` under its layout (marks); with ``optimizer``, its fp32 masters too (its
    other state is left as it is). Raises for an absent name or a shape mismatch."""
    if isinstance(file_or_state, Mapping):
        state = file_or_state
    else:
        state = torch.load(os.fspath(file_or_state), map_location="cpu", weights_only=True)
    pairs = global_names(model_params)  # a tied copy reads the tensor it copies
    for name, p in pairs:
        if name not in state:
            raise CheckpointError(f"model tensor {name!r} is absent from the state_dict")
        if list(state[name].shape) != global_shape(p):
            raise CheckpointError(
                f"shape mismatch for {name!r}: the state_dict holds {list(state[name].shape)}, "
                f"the model (global shape from its marks) {global_shape(p)}"
            )
    names: dict[int, str] = {}
    for name, p in pairs:
        names.setdefault(id(p), name)
    with torch.no_grad():
        for name, p in pairs:
            p.copy_(localize(state[name], p).to(p.dtype))
    load_optimizer(optimizer, _WeightsLookup(state, names))


__all__ = ["export_state_dict", "import_state_dict"]
