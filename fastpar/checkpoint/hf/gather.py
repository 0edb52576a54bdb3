"""``save_hf``: a sharded model gathered onto one rank (``fastpar.checkpoint.gather``) and
written as a Hugging Face directory."""

from __future__ import annotations

import os

import torch

from fastpar.checkpoint.core import _agree
from fastpar.checkpoint.format import CheckpointError
from fastpar.checkpoint.gather import gather_state
from fastpar.checkpoint.hf._common import DEFAULT_SHARD_SIZE, Rename
from fastpar.checkpoint.hf.export import export_hf
from fastpar.mesh.groups import ParallelMesh


def save_hf(
    model,
    out_dir: str | os.PathLike,
    *,
    mesh: ParallelMesh | None = None,
    config=None,
    dtype: torch.dtype | None = None,
    rename: Rename = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    model_class: type | None = None,
) -> str:
    """Write a (TP / EP) sharded model as one Hugging Face directory: every parameter's full
    tensor is gathered onto rank 0 (``gather_state``), which writes it with ``export_hf``
    (``config`` defaults to ``model.config``). Collective over the default group: every rank
    calls it; all raise if rank 0 fails. Returns the absolute path of ``out_dir``."""
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass config=")
    state = gather_state(model, mesh=mesh)
    error: BaseException | None = None
    out = os.path.abspath(os.fspath(out_dir))
    if state is not None:
        try:
            export_hf(
                state,
                out,
                config,
                dtype=dtype,
                rename=rename,
                max_shard_size=max_shard_size,
                model_class=model_class,
            )
        except BaseException as e:
            error = e
    if not _agree(error is None):
        raise error or CheckpointError(f"rank 0 failed to write {out}")
    return out
