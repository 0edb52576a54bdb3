"""Sharded checkpoints that survive a crash and a change of layout.

    from fastpar import checkpoint
    checkpoint.save(path, model_params=dict(model.named_parameters()), optimizer=opt,
                    mesh=mesh, step=step, extra={"data_position": pos})
    info = checkpoint.load(path, model_params=..., optimizer=opt, mesh=mesh)
    checkpoint.export_state_dict(path, "model.pt")       # one plain torch state_dict

See ``fastpar.checkpoint.core`` (save / load), ``format`` (the on-disk format, atomicity,
verification), ``state`` (local -> global index maps from the parameter marks) and ``pieces``
(the optimizer protocol ``checkpoint_pieces`` / ``load_checkpoint_pieces``).
"""

from __future__ import annotations

from fastpar.checkpoint.core import Lookup, layout_of, load, save, stage_param_names, verify
from fastpar.checkpoint.export import export_state_dict, import_state_dict
from fastpar.checkpoint.format import CheckpointError
from fastpar.checkpoint.pieces import load_torch_optimizer_pieces, torch_optimizer_pieces
from fastpar.checkpoint.reader import CheckpointReader

checkpoint_pieces = torch_optimizer_pieces
load_checkpoint_pieces = load_torch_optimizer_pieces

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "Lookup",
    "checkpoint_pieces",
    "export_state_dict",
    "import_state_dict",
    "layout_of",
    "load",
    "load_checkpoint_pieces",
    "save",
    "stage_param_names",
    "verify",
]
