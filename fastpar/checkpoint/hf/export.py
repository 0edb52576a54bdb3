"""``export_hf``: a fastpar checkpoint or a state_dict -> a Hugging Face model directory,
matched against the HF class built on the meta device (its names, shapes and tied aliases)."""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fastpar.checkpoint.export import export_state_dict
from fastpar.checkpoint.format import CheckpointError, atomic_json, atomic_write, fsync_dir
from fastpar.checkpoint.hf._common import (
    _WEIGHT_FILE,
    DEFAULT_SHARD_SIZE,
    INDEX_NAME,
    WEIGHTS_NAME,
    Rename,
    _groups_by_identity,
    _renamer,
    _require,
    _short,
    _size_bytes,
)
from fastpar.checkpoint.reader import CheckpointReader, dtype_from

# Auto classes tried, in order, when the config names no architecture
_AUTO_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


# -- the HF model skeleton ------------------------------------------------------------------
def _hf_config(config):
    transformers = _require("transformers")
    if isinstance(config, transformers.PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, Mapping):
        model_type = config.get("model_type")
        if model_type not in transformers.CONFIG_MAPPING:
            raise ValueError(
                f"config dict has model_type={model_type!r}: it must name a transformers model "
                f"type (e.g. 'llama', 'qwen2', 'bert')"
            )
        return transformers.CONFIG_MAPPING[model_type].from_dict(dict(config))
    raise TypeError(
        f"config must be a transformers PretrainedConfig or a dict, got {type(config).__name__}"
    )


def _candidates(config, model_class) -> list[type]:
    """HF model classes to match the weights against: ``model_class``, else the config's
    architectures, else the Auto classes of its model type."""
    if model_class is not None:
        return [model_class]
    transformers = _require("transformers")
    names = list(getattr(config, "architectures", None) or [])
    if not names:
        auto = importlib.import_module("transformers.models.auto.modeling_auto")
        for mapping in _AUTO_MAPPINGS:
            name = getattr(auto, mapping, {}).get(config.model_type)
            if isinstance(name, str) and name not in names:
                names.append(name)
    classes = [getattr(transformers, n) for n in names if hasattr(transformers, n)]
    if not classes:
        raise ValueError(
            f"no transformers model class found for model_type {config.model_type!r} "
            f"(architectures {names}); pass model_class="
        )
    return classes


@dataclass
class _Skeleton:
    cls: type
    shapes: dict[str, tuple[int, ...]]
    """Every key of the class's state_dict, tied aliases included, with its shape."""
    ties: list[list[str]]
    """Groups of keys that are one tensor in the HF model (only groups of two or more)."""


def _skeleton(cls: type, config) -> _Skeleton:
    with torch.device("meta"):
        model = cls(config)
    state = model.state_dict(keep_vars=True)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    ties = [names for names, _ in _groups_by_identity(state) if len(names) > 1]
    return _Skeleton(cls, shapes, ties)


def _complete(state: dict[str, torch.Tensor], sk: _Skeleton) -> tuple[list[str], list[str]]:
    """Add the tied aliases ``state`` lacks (in place); return (missing, unexpected) keys."""
    for names in sk.ties:
        present = [n for n in names if n in state]
        if not present:
            continue
        first = state[present[0]]
        for n in present[1:]:
            if state[n].shape != first.shape or not torch.equal(state[n], first):
                raise CheckpointError(
                    f"{n!r} and {present[0]!r} are one tied tensor in {sk.cls.__name__}, but the "
                    f"source holds different values for them; untie them in the config "
                    f"(tie_word_embeddings=False) or export one value"
                )
        for n in names:
            state.setdefault(n, first)
    missing = [n for n in sk.shapes if n not in state]
    unexpected = [n for n in state if n not in sk.shapes]
    return missing, unexpected


def _match(state: dict[str, torch.Tensor], config, model_class) -> _Skeleton:
    """The HF class whose keys ``state`` matches (aliases added to ``state``); raises naming
    the missing and unexpected keys and the shape mismatches."""
    first: tuple | None = None
    for cls in _candidates(config, model_class):
        sk = _skeleton(cls, config)
        trial = dict(state)
        missing, unexpected = _complete(trial, sk)
        if not missing and not unexpected:
            state.update(trial)
            bad = [
                f"{n!r}: the source holds {list(t.shape)}, {cls.__name__} expects "
                f"{list(sk.shapes[n])}"
                for n, t in state.items()
                if tuple(t.shape) != sk.shapes[n]
            ]
            if bad:
                raise CheckpointError("shape mismatch for " + "; ".join(bad))
            return sk
        first = first or (cls, missing, unexpected)
    cls, missing, unexpected = first
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} keys: {_short(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} keys: {_short(unexpected)}")
    raise CheckpointError(
        f"the weights do not match {cls.__name__} ({'; '.join(parts)}); map fastpar names to "
        f"HF names with rename= (a callable or a dict), or pass model_class="
    )


# -- export ---------------------------------------------------------------------------------
def _source_state(source) -> dict[str, torch.Tensor]:
    """{name: full tensor} of a state_dict, or of a fastpar checkpoint in the dtypes its model
    held (not the fp32 masters)."""
    if isinstance(source, Mapping):
        return {n: t.detach() for n, t in source.items()}
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(os.fspath(source))
    dtypes = {n: dtype_from(info["dtype"]) for n, info in reader.tensors.items()}
    return {n: t.to(dtypes[n]) for n, t in export_state_dict(reader).items()}


def _plan_files(state: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Greedy split of the names into files of at most ``limit`` bytes (a larger tensor gets
    a file of its own)."""
    files: list[list[str]] = []
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if not files or (size + nbytes > limit and files[-1]):
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def _standalone(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that share no storage (aliases and views copied)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage()
        whole = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if storage.data_ptr() in seen or not whole:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _write_weights(state: Mapping[str, torch.Tensor], out_dir: str, limit: int) -> list[str]:
    """Safetensors files (one, or several plus the index) in ``out_dir``; stale weight files
    of an earlier export are removed. Returns the file names."""
    st = _require("safetensors.torch")
    groups = _plan_files(state, limit)
    n = len(groups)
    names = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for fname, keys in zip(names, groups, strict=True):
        data = st.save(_standalone({k: state[k] for k in keys}), metadata={"format": "pt"})
        atomic_write(os.path.join(out_dir, fname), lambda f, data=data: f.write(data))
    written = list(names)
    if n > 1:
        where = {k: fname for fname, keys in zip(names, groups, strict=True) for k in keys}
        meta = {
            "total_parameters": sum(t.numel() for t in state.values()),
            "total_size": sum(t.numel() * t.element_size() for t in state.values()),
        }
        index = {"metadata": meta, "weight_map": dict(sorted(where.items()))}
        atomic_json(index, os.path.join(out_dir, INDEX_NAME))
        written.append(INDEX_NAME)
    for old in os.listdir(out_dir):
        if _WEIGHT_FILE.fullmatch(old) and old not in written:
            os.remove(os.path.join(out_dir, old))
    fsync_dir(out_dir)
    return written


def export_hf(
    source,
    out_dir: str | os.PathLike,
    config,
    *,
    dtype: torch.dtype | None = None,
    rename: Rename = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    model_class: type | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """Write a Hugging Face model directory (safetensors weights, config.json) that
    ``from_pretrained`` loads with no missing or unexpected keys, from ``source`` (a checkpoint
    directory, a ``CheckpointReader`` or a full state_dict). Runs in one process; returns the
    absolute path of ``out_dir``. The arguments: docs/checkpoints.md ("Hugging Face")."""
    cfg = _hf_config(config)
    to_hf = _renamer(rename)
    state: dict[str, torch.Tensor] = {}
    for name, t in _source_state(source).items():
        hf_name = to_hf(name)
        if hf_name is None:
            continue
        if hf_name in state:
            raise CheckpointError(f"rename maps two tensors to {hf_name!r} (one is {name!r})")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        state[hf_name] = t
    sk = _match(state, cfg, model_class)
    state = {n: state[n] for n in sk.shapes}  # the HF model's own order
    clash = sorted(set(extra or {}) & set(state))
    if clash:
        raise CheckpointError(f"extra tensors {_short(clash)} are the model's own: drop them")
    state.update({n: t.detach() for n, t in (extra or {}).items()})
    cfg.architectures = [sk.cls.__name__]
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floats) == 1:
        cfg.dtype = next(iter(floats))
    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out, exist_ok=True)
    _write_weights(state, out, _size_bytes(max_shard_size))
    cfg.save_pretrained(out)
    return out
