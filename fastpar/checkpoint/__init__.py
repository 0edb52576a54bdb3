"""Sharded checkpoints that survive a crash and a change of layout.

    from fastpar import checkpoint
    checkpoint.save(path, model_params=dict(model.named_parameters()), optimizer=opt,
                    mesh=mesh, step=step, extra={"data_position": pos})
    info = checkpoint.load(path, model_params=..., optimizer=opt, mesh=mesh)
    checkpoint.export_hf(path, "hf_out", model.config)    # a Hugging Face directory

The modules and the format: docs/checkpoints.md. WARNING: ``torch.distributed.checkpoint`` on
fastpar's plain shards reloads ONE rank's shard on every rank; use ``fastpar.checkpoint.dcp``."""

from __future__ import annotations

from fastpar.checkpoint.core import Lookup, layout_of, load, save, stage_param_names, verify
from fastpar.checkpoint.dcp import check_state_dict as check_dcp_state_dict
from fastpar.checkpoint.dcp import from_dtensor_state_dict, to_dtensor_state_dict
from fastpar.checkpoint.directory import latest_checkpoint
from fastpar.checkpoint.export import export_state_dict, import_state_dict
from fastpar.checkpoint.format import CheckpointError
from fastpar.checkpoint.gather import gather_grads, gather_like
from fastpar.checkpoint.hf import (
    LoadStats,
    ShardedSaveError,
    export_hf,
    gather_state,
    guard_save_pretrained,
    load_hf,
    save_hf,
)
from fastpar.checkpoint.lock import DirectoryLock, LockHeld
from fastpar.checkpoint.reader import CheckpointReader
from fastpar.checkpoint.state import mark_tied_copy
from fastpar.optim.pieces import load_torch_optimizer_pieces, torch_optimizer_pieces

checkpoint_pieces = torch_optimizer_pieces
load_checkpoint_pieces = load_torch_optimizer_pieces

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "DirectoryLock",
    "LoadStats",
    "LockHeld",
    "Lookup",
    "ShardedSaveError",
    "check_dcp_state_dict",
    "checkpoint_pieces",
    "export_hf",
    "export_state_dict",
    "from_dtensor_state_dict",
    "gather_grads",
    "gather_like",
    "gather_state",
    "guard_save_pretrained",
    "import_state_dict",
    "latest_checkpoint",
    "layout_of",
    "load",
    "load_checkpoint_pieces",
    "load_hf",
    "mark_tied_copy",
    "save",
    "save_hf",
    "stage_param_names",
    "to_dtensor_state_dict",
    "verify",
]
