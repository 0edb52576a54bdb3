"""Shared by the Hugging Face checkpoint modules: the optional-dependency import, renaming,
shard sizes, file names and the grouping of tied tensors."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping

from fastpar.checkpoint.state import _groups_by_identity, _targets  # noqa: F401 (re-exported)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")

Rename = Callable[[str], "str | None"] | Mapping[str, str] | None


def _require(module: str):
    """Import an optional dependency, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"fastpar.checkpoint.hf needs {module} ({e}); install it with: pip install fastpar[hf]"
        ) from e


def _renamer(rename: Rename) -> Callable[[str], str | None]:
    """fastpar name -> HF name (None drops the tensor); a dict maps the names it lists."""
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        return lambda name: rename.get(name, name)
    if callable(rename):
        return rename
    raise TypeError(f"rename must be a callable or a dict, got {type(rename).__name__}")


def _size_bytes(size: int | str) -> int:
    """5_000_000, "5GB", "500MB", "2GiB" -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B)\s*", str(size), flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"max_shard_size {size!r}: use bytes (int) or a string like '5GB'")
    unit = m.group(2).upper()
    scale = 1024 if "I" in unit else 1000
    return int(m.group(1)) * scale ** ("KMG".index(unit[0]) + 1)


def _short(names, limit: int = 8) -> str:
    names = list(names)
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more
