"""Sharded checkpoints that survive a crash and a change of layout.

    from fastpar import checkpoint
    checkpoint.save(path, model_params=dict(model.named_parameters()), optimizer=opt,
                    mesh=mesh, step=step, extra={"data_position": pos})
    info = checkpoint.load(path, model_params=..., optimizer=opt, mesh=mesh)
    checkpoint.export_state_dict(path, "model.pt")       # one plain torch state_dict
    checkpoint.export_hf(path, "hf_out", model.config)    # a Hugging Face directory
    checkpoint.load_hf(model, "hf_dir")                   # each rank reads only its slices

See ``fastpar.checkpoint.core`` (save / load), ``format`` (the on-disk format, atomicity,
verification, one save's shards only), ``state`` (local -> global index maps from the parameter
marks; ``mark_tied_copy``: a pipeline's copy of a tied embedding saved as the embedding),
``directory`` (a directory of ``step_<N>`` checkpoints: numeric order, judging, pruning),
``lock`` (one writer per directory), ``dcp`` (torch.distributed.checkpoint through DTensors
built from the marks: ``to_dtensor_state_dict`` / ``from_dtensor_state_dict``) and ``hf``
(Hugging Face safetensors both ways; needs ``pip install fastpar[hf]``, imported lazily),
``spans`` (which records of which file a loading rank needs), ``cli`` (``python -m
fastpar.checkpoint info|verify|export``). An optimizer takes part through the protocol
of ``fastpar.optim.pieces`` (``checkpoint_pieces`` / ``load_checkpoint_pieces``); the two
functions of those names here implement it for a torch optimizer.

WARNING: ``torch.distributed.checkpoint`` on fastpar's plain shards (``dcp.save(
model.state_dict())`` of a TP or EP model) saves without error and reloads ONE rank's shard on
every rank. Use ``fastpar.checkpoint.dcp`` (DTensors of the global tensors, resharding at
load) or this package's own ``save``; ``check_dcp_state_dict`` refuses such a state dict.
"""

from __future__ import annotations

from fastpar.checkpoint.core import Lookup, layout_of, load, save, stage_param_names, verify
from fastpar.checkpoint.dcp import check_state_dict as check_dcp_state_dict
from fastpar.checkpoint.dcp import from_dtensor_state_dict, to_dtensor_state_dict
from fastpar.checkpoint.directory import latest_checkpoint
from fastpar.checkpoint.export import export_state_dict, import_state_dict
from fastpar.checkpoint.format import CheckpointError
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
