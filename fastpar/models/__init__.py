"""Models built only from fastpar layers."""

from __future__ import annotations

from fastpar.models.gpt import GPTConfig, build_gpt, gpt_loss

__all__ = ["GPTConfig", "build_gpt", "gpt_loss"]
