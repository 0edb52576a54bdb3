"""Hugging Face checkpoints both ways: export to a directory ``from_pretrained`` loads, import
into a sharded model reading only this rank's slices.

    export_hf("ckpt/step_100", "hf_out", model.config)        # fastpar checkpoint -> HF dir
    stats = load_hf(model, "hf_dir")                           # each rank reads its own slices
    save_hf(model, "hf_out", mesh=mesh)                        # sharded model -> HF dir (rank 0)

transformers and safetensors are imported when first needed (docs/checkpoints.md)."""

from __future__ import annotations

from fastpar.checkpoint.hf.export import export_hf
from fastpar.checkpoint.hf.gather import gather_state, save_hf
from fastpar.checkpoint.hf.load import LoadStats, load_hf
from fastpar.nn.guard import ShardedSaveError, guard_save_pretrained

__all__ = [
    "LoadStats",
    "ShardedSaveError",
    "export_hf",
    "gather_state",
    "guard_save_pretrained",
    "load_hf",
    "save_hf",
]
