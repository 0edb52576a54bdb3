"""``load_hf``: a Hugging Face safetensors checkpoint -> a model fastpar may have sharded, each
rank reading only the slices its parameter marks map to."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from fastpar.checkpoint.format import CheckpointError
from fastpar.checkpoint.hf._common import (
    INDEX_NAME,
    WEIGHTS_NAME,
    Rename,
    _renamer,
    _require,
    _short,
    _targets,
)
from fastpar.checkpoint.state import _dim_maps, encode_runs, global_shape


# -- sliced import --------------------------------------------------------------------------
@dataclass
class LoadStats:
    """What ``load_hf`` did on this rank."""

    bytes_read: int = 0
    """Bytes of tensor data read from the files (this rank's slices; replicated tensors whole)."""
    loaded: list[str] = field(default_factory=list)
    """Checkpoint keys read."""
    missing: list[str] = field(default_factory=list)
    """Model tensors absent from the checkpoint (non-strict only; left as they were)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint keys no model tensor claims (non-strict only; not read)."""
    converted: dict[str, str] = field(default_factory=dict)
    """{key: "torch.bfloat16 -> torch.float32"} where the file's dtype differs from the model's."""
    files: list[str] = field(default_factory=list)
    """The safetensors files opened."""


def _weight_map(directory: str) -> dict[str, str]:
    """{key: safetensors file path} of a single file or an index.json checkpoint."""
    path = os.path.abspath(os.fspath(directory))
    if os.path.isfile(path):
        if path.endswith(".json"):
            index, root = path, os.path.dirname(path)
        else:
            return dict.fromkeys(_keys_of(path), path)
    else:
        index, root = os.path.join(path, INDEX_NAME), path
        if not os.path.exists(index):
            single = os.path.join(path, WEIGHTS_NAME)
            if not os.path.exists(single):
                raise CheckpointError(
                    f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path} (load_hf reads safetensors "
                    f"checkpoints; convert a pytorch_model.bin one with transformers first)"
                )
            return dict.fromkeys(_keys_of(single), single)
    with open(index) as f:
        wmap = json.load(f).get("weight_map")
    if not isinstance(wmap, dict):
        raise CheckpointError(f"{index} has no weight_map")
    out = {k: os.path.join(root, v) for k, v in wmap.items()}
    for file in sorted(set(out.values())):
        if not os.path.exists(file):
            raise CheckpointError(f"{index} names {os.path.basename(file)}, which is missing")
    return out


def _keys_of(file: str) -> list[str]:
    safetensors = _require("safetensors")
    with safetensors.safe_open(file, framework="pt") as f:
        return list(f.keys())


def _dim_runs(m: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the contiguous ranges of one dim's index map;
    padding (-1) is the tail of the local dim (see ``fastpar.checkpoint.state``)."""
    kept = int((m >= 0).sum())
    if not bool((m[:kept] >= 0).all()):
        raise ValueError("a shard's padding must come after its real rows")
    out, local = [], 0
    for start, length in encode_runs(m[:kept]).tolist():
        out.append((local, start, length))
        local += length
    return out


def _blocks(t: torch.Tensor) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """(local index, global index) pairs of the boxes that make up ``t``'s non-padding part."""
    maps = _dim_maps(t)[0]
    per_dim = [_dim_runs(m) for m in maps]
    return [
        (tuple(slice(lo, lo + n) for lo, _, n in box), tuple(slice(g, g + n) for _, g, n in box))
        for box in itertools.product(*per_dim)
    ]


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def load_hf(
    model_or_named_params,
    directory: str | os.PathLike,
    *,
    strict: bool = True,
    rename: Rename = None,
) -> LoadStats:
    """Load a Hugging Face safetensors checkpoint (a directory with model.safetensors or
    model.safetensors.index.json, or one such file) into a model fastpar may have sharded: each
    rank reads only its own slices, with no collective. The arguments and what is refused:
    docs/checkpoints.md ("Hugging Face")."""
    safetensors = _require("safetensors")
    wmap = _weight_map(directory)
    to_hf = _renamer(rename)
    stats = LoadStats()
    plan: list[tuple[str, torch.Tensor]] = []
    claimed: set[str] = set()
    for names, t in _targets(model_or_named_params):
        keys = [k for k in (to_hf(n) for n in names) if k is not None]
        claimed.update(keys)
        present = [k for k in keys if k in wmap]
        if present:
            plan.append((present[0], t))
        elif keys:
            stats.missing.append(keys[0])
    stats.unexpected = [k for k in wmap if k not in claimed]
    if strict and (stats.missing or stats.unexpected):
        parts = []
        if stats.missing:
            parts.append(
                f"{len(stats.missing)} model tensors are absent from it: {_short(stats.missing)}"
            )
        if stats.unexpected:
            parts.append(
                f"it holds {len(stats.unexpected)} keys no model tensor claims: "
                f"{_short(stats.unexpected)}"
            )
        raise CheckpointError(
            f"checkpoint {os.fspath(directory)} does not match the model: {'; '.join(parts)} "
            f"(map names with rename=, or pass strict=False)"
        )
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def opened(key: str):
            file = wmap[key]
            if file not in handles:
                handles[file] = stack.enter_context(safetensors.safe_open(file, framework="pt"))
                stats.files.append(file)
            return handles[file]

        slices = [(key, t, opened(key).get_slice(key)) for key, t in plan]
        bad = [
            f"{key!r}: the checkpoint holds {list(sl.get_shape())}, the model (global shape "
            f"from its marks) {global_shape(t)}"
            for key, t, sl in slices
            if list(sl.get_shape()) != global_shape(t)
        ]
        if bad:
            raise CheckpointError("shape mismatch for " + "; ".join(bad))
        with torch.no_grad():
            for key, t, sl in slices:
                stats.bytes_read += _read_into(t, sl)
                stats.loaded.append(key)
                file_dtype = _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                if file_dtype != t.dtype:
                    stats.converted[key] = f"{file_dtype} -> {t.dtype}"
    if stats.converted:
        kinds = sorted(set(stats.converted.values()))
        warnings.warn(
            f"load_hf converted {len(stats.converted)} tensors ({', '.join(kinds)}), e.g. "
            f"{next(iter(stats.converted))!r}",
            stacklevel=2,
        )
    return stats


def _read_into(t: torch.Tensor, sl) -> int:
    """Fill ``t`` (this rank's part) from the safetensors slice ``sl`` box by box; padding
    becomes zero. Returns the bytes read."""
    nread = 0
    buf = None
    for local, glob in _blocks(t):
        part = sl[glob]
        nread += part.numel() * part.element_size()
        if buf is None:
            buf = torch.zeros(t.shape, dtype=part.dtype)
        buf[local] = part
    if buf is None:  # nothing to read (an empty tensor, or a rank holding only padding)
        t.zero_()
    else:
        t.copy_(buf)
    return nread
