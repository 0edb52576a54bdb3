"""Which implementation an op runs: a Triton kernel, the C++ extension, or the torch reference.

Rule (``select``): an override wins (``FASTPAR_BACKEND=triton|reference`` in the environment,
or the ``use_backend`` context manager); otherwise CUDA tensors take Triton when it imports and
everything else takes the pure-torch reference. Forcing Triton on CPU tensors is how CI runs
every kernel under ``TRITON_INTERPRET=1``.

Ops register themselves with ``register_op`` so ``python -m fastpar.info`` can list them.
Triton and the extension are probed lazily, on first use, never at ``import fastpar``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

BACKENDS = ("triton", "extension", "reference")
ENV_VAR = "FASTPAR_BACKEND"
_override: list[str] = []


@dataclass(frozen=True)
class OpInfo:
    """An op's name, the backends it implements, and a one-line description."""

    name: str
    backends: tuple[str, ...]
    doc: str = ""


_OPS: dict[str, OpInfo] = {}


def register_op(name: str, backends: tuple[str, ...], doc: str = "") -> OpInfo:
    """Record an op (its ``backends`` must include "reference"); returns its OpInfo."""
    bad = [b for b in backends if b not in BACKENDS]
    if bad or "reference" not in backends:
        raise ValueError(
            f"op {name!r}: backends {backends} must be drawn from {BACKENDS} and include 'reference'"
        )
    info = OpInfo(name, tuple(backends), doc)
    _OPS[name] = info
    return info


def registered_ops() -> dict[str, OpInfo]:
    return dict(_OPS)


@functools.cache
def triton_status() -> tuple[bool, str]:
    """(importable, version or the reason it is not)."""
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install
        return False, f"not available ({type(exc).__name__}: {exc})"
    return True, getattr(triton, "__version__", "unknown version")


@functools.cache
def extension_status() -> tuple[bool, str]:
    """(built, a short description) for the C++/CUDA extension ``fastpar._C``."""
    try:
        importlib.import_module("fastpar._C")
    except Exception as exc:
        return False, f"not built ({type(exc).__name__}: {exc})"
    return True, "built"


def _forced() -> str | None:
    name = _override[-1] if _override else os.environ.get(ENV_VAR, "").strip().lower() or None
    if name in (None, "auto"):
        return None
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r} is not one of auto/{'/'.join(BACKENDS)}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every op inside the block onto ``name`` ("triton", "extension", "reference", "auto")."""
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"backend {name!r} is not one of auto/{'/'.join(BACKENDS)}")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def select(op: str, device_type: str) -> str:
    """The backend ``op`` runs for tensors on ``device_type`` ("cuda", "cpu", ...)."""
    info = _OPS.get(op)
    available = info.backends if info else ("reference",)
    forced = _forced()
    if forced is not None:
        if forced not in available:
            raise ValueError(f"op {op!r} has no {forced!r} backend (it has {available})")
        if forced == "triton" and not triton_status()[0]:
            raise RuntimeError(
                f"{ENV_VAR}/use_backend asks for Triton, which is {triton_status()[1]}"
            )
        return forced
    if device_type == "cuda" and "triton" in available and triton_status()[0]:
        return "triton"
    return "reference"
