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

import contextlib
import copy
import importlib
import itertools
import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpar.checkpoint.core import _agree
from fastpar.checkpoint.export import export_state_dict
from fastpar.checkpoint.format import CheckpointError, atomic_json, atomic_write, fsync_dir
from fastpar.checkpoint.reader import CheckpointReader, dtype_from
from fastpar.checkpoint.state import (
    PieceMapper,
    _coords,
    _dim_maps,
    decode_runs,
    encode_runs,
    global_shape,
    writes_on_this_rank,
)
from fastpar.nn.guard import ShardedSaveError, guard_save_pretrained

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
# Auto classes tried, in order, when the config names no architecture
_AUTO_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)

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


def _groups_by_identity(tensors: Mapping[str, torch.Tensor]) -> list[tuple[list[str], Any]]:
    """[(every name of one tensor object, that tensor)] in first-seen order (ties grouped)."""
    out: dict[int, tuple[list[str], Any]] = {}
    for name, t in tensors.items():
        out.setdefault(id(t), ([], t))[0].append(name)
    return list(out.values())


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
) -> str:
    """Write a Hugging Face model directory (safetensors weights, config.json) that
    ``from_pretrained`` loads with no missing or unexpected keys.

    ``source``: a fastpar checkpoint directory (``fastpar.checkpoint.save``), a
    ``CheckpointReader``, or a full state_dict {name: global tensor}. ``config``: a
    transformers ``PretrainedConfig`` or a config dict (with "model_type"). ``dtype``: cast
    floating tensors to it (default: as the model held them; a state_dict as given).
    ``rename``: fastpar name -> HF name, a callable (returning None drops a tensor) or a dict
    (unlisted names kept). ``max_shard_size``: bytes or "5GB"; above it the weights go to
    several files plus model.safetensors.index.json. ``model_class``: the HF class (default:
    ``config.architectures``, else the first Auto class of the model type whose keys match).
    Tied aliases the source lacks are added, each as its own tensor. Runs in one process.
    Returns the absolute path of ``out_dir``.
    """
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
    cfg.architectures = [sk.cls.__name__]
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floats) == 1:
        cfg.dtype = next(iter(floats))
    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out, exist_ok=True)
    _write_weights(state, out, _size_bytes(max_shard_size))
    cfg.save_pretrained(out)
    return out


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
        (
            tuple(slice(lo, lo + n) for lo, _, n in box),
            tuple(slice(g, g + n) for _, g, n in box),
        )
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


def _targets(model_or_named_params) -> list[tuple[list[str], torch.Tensor]]:
    """[(names of one tensor, tensor)]: a module's parameters and persistent buffers (tied
    parameters under all their names), or a {name: tensor} dict."""
    if isinstance(model_or_named_params, nn.Module):
        tensors = model_or_named_params.state_dict(keep_vars=True)
    elif isinstance(model_or_named_params, Mapping):
        tensors = model_or_named_params
    else:
        raise TypeError(
            f"load_hf takes an nn.Module or a {{name: tensor}} dict, got "
            f"{type(model_or_named_params).__name__}"
        )
    return _groups_by_identity(tensors)


def load_hf(
    model_or_named_params,
    directory: str | os.PathLike,
    *,
    strict: bool = True,
    rename: Rename = None,
) -> LoadStats:
    """Load a Hugging Face safetensors checkpoint (a directory with model.safetensors or
    model.safetensors.index.json, or one such file) into a model fastpar may have sharded.

    Each rank reads only its own slices, found from the parameter marks (TP-sharded dims,
    fused blocks, vocabulary padding, experts); unmarked and replicated tensors are read whole.
    No collective: works on any subset of ranks and without a process group. ``rename``: as in
    ``export_hf`` (fastpar name -> HF name). ``strict``: raise for model tensors absent from
    the checkpoint and checkpoint keys no tensor claims (else report them in the stats). A
    global shape mismatch always raises, before anything is loaded. Tensors whose file dtype
    differs from the model's are converted, listed in ``stats.converted`` and warned about.
    """
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


# -- gathering a sharded model, and the save_pretrained guard -------------------------------
def _named_tensors(model_or_named_params) -> dict[str, torch.Tensor]:
    """{first name: tensor} of each distinct tensor (a module: parameters and persistent
    buffers)."""
    return {names[0]: t for names, t in _targets(model_or_named_params)}


def gather_state(model_or_named_params, *, mesh=None, dst: int = 0) -> dict | None:
    """{name: full global tensor} of a (TP / EP) sharded model on global rank ``dst``, None on
    the other ranks (collective over the default group: every rank calls it with the same
    names; no pipeline parallelism). Pieces come from the marks; with ``mesh`` only the
    first holder of duplicated data sends it. Without a process group: the model's own
    tensors (sharded ones still reassembled from their marks)."""
    named = _named_tensors(model_or_named_params)
    rank, world = _coords(None)
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, list(named))
        if any(names != everyone[0] for names in everyone):
            raise CheckpointError(
                "gather_state / save_hf need every rank to hold every parameter under the same "
                "names (no pipeline parallelism): use fastpar.checkpoint.save, then export_hf"
            )
    mapper = PieceMapper()
    out: dict[str, torch.Tensor] | None = {} if rank == dst else None
    for name, t in named.items():
        sends = mesh is None or writes_on_this_rank(t, mesh, dp_sharded=False)
        piece = mapper(t, "model", t.detach(), 0, t.numel()) if sends else None
        pieces = [piece]
        if world > 1:
            pieces = [None] * world if rank == dst else None
            dist.gather_object(piece, pieces, dst=dst)
        if out is not None:
            out[name] = _assemble(name, global_shape(t), t.dtype, pieces)
    return out


def _assemble(name: str, shape: list[int], dtype: torch.dtype, pieces: list) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    full = torch.zeros(numel, dtype=dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for piece in pieces:
        if piece is not None:
            idx = decode_runs(piece[0])
            full[idx] = piece[1].to(dtype)
            covered[idx] = True
    if not bool(covered.all()):
        raise CheckpointError(
            f"the ranks' pieces of {name!r} cover {int(covered.sum())} of its {numel} elements: "
            f"is the mesh the one the model was sharded with?"
        )
    return full.view(shape)


def save_hf(
    model,
    out_dir: str | os.PathLike,
    *,
    mesh=None,
    config=None,
    dtype: torch.dtype | None = None,
    rename: Rename = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    model_class: type | None = None,
) -> str:
    """Write a (TP / EP) sharded model as one Hugging Face directory: every parameter's full
    tensor is gathered onto rank 0 (``gather_state``), which writes it with ``export_hf``
    (``config`` defaults to ``model.config``). Collective over the default group: every rank
    calls it; all raise if rank 0 fails. Returns the absolute path of ``out_dir``."""
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass config=")
    state = gather_state(model, mesh=mesh)
    error: BaseException | None = None
    out = os.path.abspath(os.fspath(out_dir))
    if state is not None:
        try:
            export_hf(
                state,
                out,
                config,
                dtype=dtype,
                rename=rename,
                max_shard_size=max_shard_size,
                model_class=model_class,
            )
        except BaseException as e:
            error = e
    if not _agree(error is None):
        raise error or CheckpointError(f"rank 0 failed to write {out}")
    return out


__all__ = [
    "LoadStats",
    "ShardedSaveError",
    "export_hf",
    "gather_state",
    "guard_save_pretrained",
    "load_hf",
    "save_hf",
]
