"""Which implementation an op runs: a Triton kernel, the C++ extension, or the torch reference.

``select``: an override (``use_backend``, else ``FASTPAR_BACKEND``) wins; otherwise CUDA tensors
take Triton when it imports, everything else the reference (docs/kernels.md, "Choosing a
backend"). Ops ``register_op`` themselves for ``python -m fastpar.info``; Triton and the
extension are probed lazily, never at ``import fastpar``.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from fastpar.switches import Setting, Switch, choice

BACKENDS = ("triton", "extension", "reference")
ENV_VAR = "FASTPAR_BACKEND"


def _check(name: str) -> str:
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"backend {name!r} is not one of auto/{'/'.join(BACKENDS)}")
    return name


SWITCH = Switch(ENV_VAR, choice(ENV_VAR, BACKENDS), _check)


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


BUILD_INFO = Path(__file__).parents[1] / "_C_build.json"
"""Written by setup.py when it builds fastpar._C: the torch version it was built against."""


@functools.cache
def extension_status() -> tuple[bool, str]:
    """(built, a short description) for the C++/CUDA extension ``fastpar._C``. An extension
    built against another torch than the one running is not loaded (its C++ ABI may differ: it
    can crash the process): setup.py records the torch it built against in _C_build.json."""
    mismatch = _built_for_another_torch()
    if mismatch:
        return False, mismatch
    try:
        importlib.import_module("fastpar._C")
    except Exception as exc:
        return False, f"not built ({type(exc).__name__}: {exc})"
    return True, "built"


def _built_for_another_torch() -> str | None:
    import torch

    try:
        built = json.loads(BUILD_INFO.read_text()).get("torch")
    except (OSError, ValueError):
        return None  # no record (an older build): try to load it
    if built and built != torch.__version__:
        return (
            f"not loaded: built against torch {built}, this is torch {torch.__version__}; "
            f"rebuild it (bash scripts/setup.sh, or pip install --no-build-isolation -e .)"
        )
    return None


class use_backend(Setting):  # lower case: a call and a context manager, like debug_checks
    """Force every op onto ``name`` ("triton", "extension", "reference"; "auto": the rule
    above, whatever ``FASTPAR_BACKEND`` says): for the rest of the process, or, as a context
    manager, only inside the block. ``use_backend(None)`` hands the choice back to the
    variable."""

    SWITCH = SWITCH


def refresh() -> None:
    """Read ``FASTPAR_BACKEND`` again at the next op (after changing ``os.environ``)."""
    SWITCH.refresh()


def select(op: str, device_type: str) -> str:
    """The backend ``op`` runs for tensors on ``device_type`` ("cuda", "cpu", ...)."""
    info = _OPS.get(op)
    available = info.backends if info else ("reference",)
    forced = None if SWITCH.get() == "auto" else SWITCH.get()
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
