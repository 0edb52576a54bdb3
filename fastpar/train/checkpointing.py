"""Saving and resuming a run's checkpoints."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict

from fastpar.train.build import Trainer


def _save(trainer: Trainer, root: str, step: int, talk: bool) -> None:
    from fastpar import checkpoint

    path = os.path.join(root, f"step_{step:06d}")
    ctx = trainer.model.summon_full_params() if trainer.cfg.zero == 3 else contextlib.nullcontext()
    with ctx:
        checkpoint.save(
            path, model_params=trainer.named_parameters(), optimizer=trainer.opt, mesh=trainer.mesh,
            step=step, extra={"step": step, "config": asdict(trainer.cfg)}, overwrite=True,
        )  # fmt: skip
    if talk:
        print(f"checkpoint: {path}", flush=True)


def latest_checkpoint(root: str) -> str | None:
    from fastpar import checkpoint

    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root), reverse=True):
        path = os.path.join(root, name)
        if name.startswith("step_") and not name.endswith(".partial"):
            try:
                checkpoint.verify(path)
                return path
            except Exception:
                continue
    return None


def _resume(trainer: Trainer, root: str, talk: bool) -> int:
    from fastpar import checkpoint

    path = latest_checkpoint(root)
    if path is None:
        if talk:
            print(f"resume: no complete checkpoint in {root}; starting from step 0", flush=True)
        return 0
    ctx = trainer.model.summon_full_params() if trainer.cfg.zero == 3 else contextlib.nullcontext()
    with ctx:
        info = checkpoint.load(
            path, model_params=trainer.named_parameters(), optimizer=trainer.opt, mesh=trainer.mesh
        )
    trainer.step_count = int(info["step"])
    if talk:
        print(f"resume: {path} (step {trainer.step_count})", flush=True)
    return trainer.step_count
