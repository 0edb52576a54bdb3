"""The on-disk format: atomic file writes, checksums, the completion marker, verification. The
files of a checkpoint and the run / save ids: docs/checkpoints.md ("Inside fastpar.checkpoint")."""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import os
import sys
import zipfile
import zlib
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
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno and e.filename is None:  # a write's: no name
            raise OSError(e.errno, e.strerror, path) from None
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


def read_verified(directory: str, entry: dict, count: Callable[[int], None] | None = None) -> bytes:
    """The bytes of the file described by ``entry`` ({file, bytes, sha256}), checked;
    ``count(n)`` is told how many bytes were read."""
    path = os.path.join(directory, entry["file"])
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {directory}: file {entry['file']} is missing")
    with open(path, "rb") as f:
        data = f.read()
    if count is not None:
        count(len(data))
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


class _CountingReader(io.RawIOBase):
    """A read-only file that tells ``count(n)`` the bytes it reads from disk. With ``pages``
    (a dict kept by the caller), reads go through a cache of ``PAGE``-byte pages, so the
    parsers that read a zip's directory and pickle twice read the disk once."""

    PAGE = 1024

    def __init__(self, path: str, count: Callable[[int], None], pages: dict | None) -> None:
        self.f, self.count, self.pages = open(path, "rb"), count, pages  # noqa: SIM115
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1:
            offset += self.pos
        elif whence == 2:
            offset += os.fstat(self.f.fileno()).st_size
        self.pos = offset
        return offset

    def tell(self) -> int:
        return self.pos

    def _page(self, i: int) -> bytes:
        if i not in self.pages:
            self.f.seek(i * self.PAGE)
            self.pages[i] = self.f.read(self.PAGE)
            self.count(len(self.pages[i]))
        return self.pages[i]

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        if self.pages is None:
            self.f.seek(self.pos)
            n = self.f.readinto(view) or 0
            self.count(n)
        else:
            n = 0
            while n < len(view):
                i, at = divmod(self.pos + n, self.PAGE)
                chunk = self._page(i)[at : at + len(view) - n]
                if not chunk:
                    break
                view[n : n + len(chunk)] = chunk
                n += len(chunk)
        self.pos += n
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


class RecordFile:
    """A shard file (``torch.save``: a zip archive of records) read in part, record by record.

    Opening reads the zip's central directory; ``index()`` the pickled object (its data.pkl
    record, CRC-32 checked) with every tensor on the meta device; ``read(tensors)`` the records
    behind such meta tensors, each checked against the CRC-32 the zip holds for it. Only what is
    asked for is read, and ``count(n)`` is told every byte. ``checkable`` is False when the
    writer stored no CRC-32s (``torch.serialization.set_crc32_options(False)``) or another byte
    order: read such a file whole (``read_verified``) instead.
    """

    def __init__(self, directory: str, entry: dict, count: Callable[[int], None]) -> None:
        self.directory, self.name, self.count = directory, entry["file"], count
        self.path = os.path.join(directory, self.name)
        self._pages: dict[int, bytes] | None = {}  # the directory and index, until index()
        with self._open() as f:
            try:
                with zipfile.ZipFile(f) as z:
                    infos = z.infolist()
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                raise self._corrupted(f"is not a readable torch file ({e})") from e
        self._infos = sorted(infos, key=lambda i: i.header_offset)
        self._starts = [i.header_offset for i in self._infos]
        named = {
            i.filename.rsplit("/", 1)[-1]: i for i in self._infos if "/data/" not in i.filename
        }
        if "data.pkl" not in named:
            raise self._corrupted("is not a torch.save file (no data.pkl record)")
        self._pickle, self._order = named["data.pkl"], named.get("byteorder")
        self.checkable = self._pickle.CRC != 0 and sys.byteorder == "little"

    def _open(self, cached: bool = True) -> _CountingReader:
        if not os.path.exists(self.path):
            raise CheckpointError(f"checkpoint {self.directory}: file {self.name} is missing")
        return _CountingReader(self.path, self.count, self._pages if cached else None)

    def _corrupted(self, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.directory}: {self.name} {what}: it is corrupted")

    def _record(self, f, info: zipfile.ZipInfo, offset: int | None = None) -> bytes:
        """The bytes of record ``info`` (data at ``offset``, else after its local header),
        CRC-32 checked."""
        if info.compress_type != zipfile.ZIP_STORED:
            raise self._corrupted(f"holds a compressed record {info.filename}")
        if offset is None:
            f.seek(info.header_offset)
            head = f.read(30)
            if len(head) != 30 or head[:4] != b"PK\x03\x04":
                raise self._corrupted(f"has a broken header for {info.filename}")
            offset = info.header_offset + 30 + int.from_bytes(head[26:28], "little")
            offset += int.from_bytes(head[28:30], "little")
        f.seek(offset)
        data = f.read(info.file_size)
        if len(data) != info.file_size or (self.checkable and zlib.crc32(data) != info.CRC):
            raise CheckpointError(
                f"checkpoint {self.directory}: CRC-32 mismatch for {self.name} (record "
                f"{info.filename}): the file is corrupted"
            )
        return data

    def index(self) -> Any:
        """The file's object, every tensor on the meta device (its data not read)."""
        with self._open() as f:
            if self._order is not None and self._record(f, self._order) != b"little":
                self.checkable = False
            self._record(f, self._pickle)
            f.seek(0)
            try:
                return torch.load(f, map_location="meta", weights_only=True)
            except (RuntimeError, EOFError, ValueError, OSError, AttributeError) as e:
                raise self._corrupted(f"has an unreadable index ({e})") from e
            finally:
                self._pages = None  # later reads are records, read once each

    def read(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The CPU tensors behind meta tensors of ``index()``, their records CRC-32 checked."""
        out = []
        with self._open(cached=False) as f:
            for t in tensors:
                storage = t.untyped_storage()
                if storage.nbytes() == 0:
                    out.append(torch.empty(t.shape, dtype=t.dtype))
                    continue
                offset = getattr(storage, "_checkpoint_offset", None)
                if offset is None:  # a torch that does not say where records lie
                    raise self._corrupted("gives no record offsets to read it in part")
                info = self._infos[bisect.bisect_right(self._starts, offset) - 1]
                if info.file_size != storage.nbytes():
                    raise self._corrupted(f"holds a record {info.filename} of another size")
                data = bytearray(self._record(f, info, offset))
                real = torch.empty(0, dtype=t.dtype)
                storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
                out.append(real.set_(storage, t.storage_offset(), t.shape, t.stride()))
        return out
