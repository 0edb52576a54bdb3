"""Refuse Hugging Face's ``save_pretrained`` on a sharded model: it would write this rank's
shards as if they were the whole model, without an error."""

from __future__ import annotations

from torch import nn

from fastpar.comm import group_size
from fastpar.mesh.placement import expert_layout, param_layout


class ShardedSaveError(RuntimeError):
    """``save_pretrained`` / ``push_to_hub`` called on a model sharded by fastpar."""


def _partial(p) -> bool:
    """Whether ``p`` holds only this rank's part of its tensor (by its marks)."""
    layout = param_layout(p)
    if layout is not None and layout.kind in ("sharded", "owned") and group_size(layout.group) > 1:
        return True  # an owned tensor: one of a list whose other entries other ranks hold
    ex = expert_layout(p)
    return ex is not None and ex.num_experts != p.shape[0]


def guard_save_pretrained(model: nn.Module) -> bool:
    """Make ``model.save_pretrained`` and ``model.push_to_hub`` (this instance only) raise
    ``ShardedSaveError`` naming the supported route, when any parameter holds only this rank's
    part of its tensor. Returns whether it guarded (False for a model whole on every rank).
    ``fastpar.parallelize`` calls it."""
    params = list(model.named_parameters())
    partial = [(n, p) for n, p in params if _partial(p)]
    if not partial:
        return False
    name, p = partial[0]
    message = (
        f"{type(model).__name__} is sharded by fastpar: {len(partial)} of its {len(params)} "
        f"parameters hold only this rank's part (e.g. {name!r}, local shape {list(p.shape)}), "
        f"so Hugging Face's save_pretrained would write this rank's shards as if they were the "
        f"whole model. Save it with fastpar.checkpoint.save_hf(model, out_dir, mesh=mesh) "
        f"(every rank calls it; rank 0 writes the HF directory), or "
        f"fastpar.checkpoint.save(path, model_params=dict(model.named_parameters()), mesh=mesh, "
        f"step=step) followed by fastpar.checkpoint.export_hf(path, out_dir, model.config)."
    )

    def refuse(*args, **kwargs):
        raise ShardedSaveError(message)

    for attr in ("save_pretrained", "push_to_hub"):
        if hasattr(model, attr):
            setattr(model, attr, refuse)
    return True
