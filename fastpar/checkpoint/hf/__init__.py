"""Hugging Face checkpoints both ways: export to a directory ``from_pretrained`` loads, import
into a sharded model reading only this rank's slices.

    export_hf("ckpt/step_100", "hf_out", model.config)        # fastpar checkpoint -> HF dir
    stats = load_hf(model, "hf_dir")                           # each rank reads its own slices
    save_hf(model, "hf_out", mesh=mesh)                        # sharded model -> HF dir (rank 0)
    guard_save_pretrained(model)                               # model.save_pretrained now refuses

``export_hf`` builds the HF model class on the meta device to learn its parameter names,
shapes and tied aliases (``lm_head.weight``, BERT's ``cls.predictions.decoder.*``, which
``named_parameters()`` drops), writes every alias as its own tensor (safetensors refuses shared
storage), splits the weights into several files plus ``model.safetensors.index.json`` above
``max_shard_size``, and writes config.json. ``load_hf`` reads, for each parameter, only the
ranges its marks (``fastpar.checkpoint.state``) map to: one contiguous range per sharded dim,
one per block of a fused (q|k|v) dim, padded vocabulary rows zero-filled.

transformers and safetensors are imported when first needed (``pip install fastpar[hf]``).
"""

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
