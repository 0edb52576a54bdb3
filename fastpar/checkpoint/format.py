"""The on-disk format: atomic file writes, checksums, the completion marker, verification.

A checkpoint is a directory::

    <path>/
      rank00000.pt  rank00000.json    one shard file per rank + its sidecar (bytes, sha256,
      rank00001.pt  rank00001.json    which pieces of which global tensors it holds)
      ...
      common.pt                       rank 0: step, extra, scaler, skipped steps
      metadata.json                   rank 0: every global tensor (name, shape, dtype, how it
                                      was sharded, saved keys), the layout, every file's
                                      size and sha256, the run id and save id
      COMPLETE                        written last: the sha256 of metadata.json

Every shard file, its sidecar and the metadata carry the training run's id (``run_id``, None
outside a training run) and a random id of the save agreed by all ranks (``save_id``): a
checkpoint whose shards come from two saves (two runs writing one directory) is never
completed, and is refused by every reader if it exists.

Every file is written to a temporary name, fsync'ed and renamed; the whole directory is built
as ``<path>.partial`` and renamed to ``<path>`` only after the marker, so a crash at any
moment leaves either no ``<path>`` or a complete one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from typing import Any

import torch

FORMAT, VERSION = "fastpar-checkpoint", 1
MARKER, METADATA, COMMON = "COMPLETE", "metadata.json", "common.pt"
PARTIAL_SUFFIX = ".partial"
IDENTITY = ("run_id", "save_id")
"""The keys naming the save a shard belongs to (in each shard, sidecar and rank entry)."""


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupted, or does not fit the model it is loaded into."""


def check_same_save(directory: str, what: str, record: dict, ident: dict) -> None:
    """Raise unless ``record`` (a shard, sidecar or rank entry) names the save ``ident``."""
    got = {k: record.get(k) for k in IDENTITY}
    want = {k: ident.get(k) for k in IDENTITY}
    if got != want:
        raise CheckpointError(
            f"checkpoint {directory}: {what} comes from another save (run {got['run_id']!r}, "
            f"save {got['save_id']}) than the checkpoint (run {want['run_id']!r}, save "
            f"{want['save_id']}): two runs wrote into one checkpoint directory; refusing it"
        )


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def sidecar_file(rank: int) -> str:
    return f"rank{rank:05d}.json"


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingWriter(io.RawIOBase):
    """A write-only file wrapper that counts and hashes what passes through."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self.f.write(b)
        self.sha.update(memoryview(b)[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def atomic_write(path: str, write: Callable[[Any], None]) -> tuple[int, str]:
    """``write(file)`` into a temporary file, fsync, rename to ``path``. Returns (bytes,
    sha256 hex)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            w = _HashingWriter(f)
            write(w)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")
    return w.size, w.sha.hexdigest()


def atomic_torch_save(obj: Any, path: str) -> tuple[int, str]:
    """``torch.save`` through ``atomic_write``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return atomic_write(path, lambda f: f.write(data))


def atomic_json(obj: Any, path: str) -> tuple[int, str]:
    data = json.dumps(obj, indent=1, sort_keys=False).encode()
    return atomic_write(path, lambda f: f.write(data))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_marker(directory: str, metadata_sha256: str) -> None:
    """The completion marker, written last: a checkpoint without it is never loaded."""
    atomic_json(
        {"format": FORMAT, "version": VERSION, "metadata_sha256": metadata_sha256},
        os.path.join(directory, MARKER),
    )


def read_verified(directory: str, entry: dict) -> bytes:
    """The bytes of the file described by ``entry`` ({file, bytes, sha256}), checked."""
    path = os.path.join(directory, entry["file"])
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {directory}: file {entry['file']} is missing")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != entry["bytes"]:
        raise CheckpointError(
            f"checkpoint {directory}: {entry['file']} has {len(data)} bytes, the metadata "
            f"records {entry['bytes']} (truncated or overwritten)"
        )
    if sha256_bytes(data) != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint {directory}: sha256 mismatch for {entry['file']}: the file is corrupted"
        )
    return data


def read_metadata(directory: str) -> dict:
    """Check that ``directory`` is a complete checkpoint (marker, metadata checksum, every
    file present with its recorded size) and return its metadata. File contents are
    checksummed when read (``read_verified``)."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        partial = directory + PARTIAL_SUFFIX
        hint = (
            f"; {partial} exists: a save that did not finish (crashed mid-save) left it"
            if os.path.exists(partial)
            else ""
        )
        raise CheckpointError(f"no checkpoint at {directory}{hint}")
    marker = os.path.join(directory, MARKER)
    if not os.path.exists(marker):
        raise CheckpointError(
            f"checkpoint {directory} has no completion marker ({MARKER}): the save did not "
            f"finish; refusing to load it"
        )
    try:
        with open(marker) as f:
            mark = json.load(f)
        with open(os.path.join(directory, METADATA), "rb") as f:
            raw = f.read()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable marker or metadata: {e}") from e
    if mark.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a {FORMAT} (marker says {mark.get('format')})")
    if sha256_bytes(raw) != mark.get("metadata_sha256"):
        raise CheckpointError(
            f"checkpoint {directory}: sha256 mismatch for {METADATA}: the file is corrupted"
        )
    meta = json.loads(raw)
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(
            f"checkpoint {directory} has format version {meta['version']}; this fastpar reads "
            f"up to {VERSION}"
        )
    for entry in meta["ranks"]:
        check_same_save(directory, f"the shard {entry['file']}", entry, meta)
    for entry in [*meta["ranks"], meta["common"]]:
        path = os.path.join(directory, entry["file"])
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {directory}: file {entry['file']} is missing")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {directory}: {entry['file']} has {size} bytes, the metadata "
                f"records {entry['bytes']} (truncated or overwritten)"
            )
    return meta


def load_bytes(data: bytes, *, weights_only: bool = True) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
