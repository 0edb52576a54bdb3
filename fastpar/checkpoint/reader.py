"""``CheckpointReader``: verified access to a saved checkpoint's tensors, whatever the layout it
was saved under, reading only what is asked for (``gather``) and checking what it reads. What
is read and what is checked: docs/checkpoints.md ("Inside fastpar.checkpoint")."""

from __future__ import annotations

import math
import os

import torch

from fastpar.checkpoint.format import (
    FORMAT,
    CheckpointError,
    RecordFile,
    check_same_save,
    load_bytes,
    read_metadata,
    read_verified,
)
from fastpar.checkpoint.lock import hold_for_reading
from fastpar.checkpoint.spans import piece_sizes, wanted_pieces
from fastpar.checkpoint.state import SCALAR_KEYS, decode_runs

WHOLE = 0.75
"""A rank file is read whole (one sequential read, its sha256 checked) once the records a
gather needs from it make up this fraction of its bytes; below, record by record."""


def dtype_from(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


class _Source:
    """One rank file as read: whole (real tensors) or in part (``records``: its tensors stay on
    the meta device until ``real`` reads them). ``pieces``: {(name, key): [[runs, values]]}."""

    def __init__(self, raw: dict, records: RecordFile | None) -> None:
        self.raw, self.records = raw, records
        pieces: dict[tuple[str, str], list[list[torch.Tensor]]] = {}
        for p in raw["pieces"]:
            pieces.setdefault((p["name"], p["key"]), []).append([p["runs"], p["values"]])
        raw["pieces"] = self.pieces = pieces

    @property
    def whole(self) -> bool:
        return self.records is None

    def real(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` with every meta one read from the file (one pass, CRC-32 checked)."""
        metas = [t for t in tensors if t.is_meta]
        if not metas:
            return list(tensors)
        got = iter(self.records.read(metas))
        return [next(got) if t.is_meta else t for t in tensors]

    def tree(self, obj):
        """``obj`` (dicts, lists, tuples of tensors and plain values) with its tensors read."""
        flat: list[torch.Tensor] = []

        def walk(o):
            if torch.is_tensor(o):
                flat.append(o)
            for v in (
                o.values() if isinstance(o, dict) else o if isinstance(o, list | tuple) else ()
            ):
                walk(v)

        def build(o, got):
            if torch.is_tensor(o):
                return next(got)
            if isinstance(o, dict):
                return {k: build(v, got) for k, v in o.items()}
            if isinstance(o, list | tuple):
                return type(o)(build(v, got) for v in o)
            return o

        walk(obj)
        return build(obj, iter(self.real(flat)))


def _match(runs: torch.Tensor, want: torch.Tensor | None, done: torch.Tensor) -> tuple:
    """(positions in ``want``, positions in the piece) of the wanted elements a piece with
    global ``runs`` holds that ``done`` lacks; ``want`` None: every element, positions are
    global indices. ``want`` is sorted, without repeats."""
    starts, lengths = runs[:, 0].contiguous(), runs[:, 1].contiguous()
    if want is None:
        pos = decode_runs(runs)
        at = torch.arange(pos.numel())
    else:
        lo = torch.searchsorted(want, starts)
        counts = torch.searchsorted(want, starts + lengths) - lo
        run = torch.repeat_interleave(torch.arange(len(starts)), counts)
        first = torch.cumsum(counts, 0) - counts
        pos = torch.arange(int(counts.sum())) - first[run] + lo[run]
        at = (torch.cumsum(lengths, 0) - lengths)[run] + want[pos] - starts[run]
    keep = ~done[pos]
    return pos[keep], at[keep]


class CheckpointReader:
    """Opens ``path`` after checking its marker, metadata and file sizes; rank files are read
    only when a tensor they hold is asked for (docs/checkpoints.md: what is read, what checked).

    ``tensors``: {global name: {"shape", "dtype", "sharding", "keys": {key: {"shape",
    "dtype"}}}}; ``layout``: how it was saved; ``gather``: chosen elements of global tensors;
    ``assemble(name, key)``: a whole global tensor. Until ``release()`` it holds a shared lock
    on the checkpoint, so ``--keep-last`` pruning never deletes it while it is read.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._hold = hold_for_reading(self.path)
        try:
            self.meta = read_metadata(self.path)
        except BaseException:
            self.release()
            raise
        self.tensors: dict[str, dict] = self.meta["tensors"]
        self.layout: dict = self.meta["layout"]
        self._files: dict[int, _Source] = {}
        self._full: dict[tuple[str, str], torch.Tensor] = {}
        self._common: dict | None = None
        self.bytes_read = 0
        self.file_bytes: dict[str, int] = {}

    def _counter(self, name: str):
        def count(n: int) -> None:
            self.bytes_read += n
            self.file_bytes[name] = self.file_bytes.get(name, 0) + n

        return count

    def _check(self, entry: dict, raw) -> None:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or "pieces" not in raw:
            raise CheckpointError(
                f"checkpoint {self.path}: {entry['file']} is not a {FORMAT} shard"
            )
        check_same_save(self.path, f"the shard {entry['file']}", raw, self.meta)

    def _whole(self, rank: int) -> _Source:
        """Rank ``rank``'s file read in full, its sha256 checked."""
        src = self._files.get(rank)
        if src is None or not src.whole:
            entry = self.meta["ranks"][rank]
            raw = load_bytes(read_verified(self.path, entry, self._counter(entry["file"])))
            self._check(entry, raw)
            src = self._files[rank] = _Source(raw, None)
        return src

    def _opened(self, rank: int) -> _Source:
        """Rank ``rank``'s file as read so far: at least its index."""
        src = self._files.get(rank)
        if src is None:
            entry = self.meta["ranks"][rank]
            try:
                records = RecordFile(self.path, entry, self._counter(entry["file"]))
                raw = records.index()
                self._check(entry, raw)
            except CheckpointError:  # read it whole: its sha256 says what is wrong
                return self._whole(rank)
            if not records.checkable:  # no CRC-32s to check records against
                return self._whole(rank)
            src = self._files[rank] = _Source(raw, records)
        return src

    def rank_data(self, rank: int) -> dict:
        """The parsed shard file of ``rank``, read whole: {"pieces": {(name, key): [[runs,
        values]]}, "rng": ..., ...}."""
        return self._whole(rank).raw

    def rng_state(self, rank: int):
        """The RNG states saved by ``rank`` (None if not saved), reading only them."""
        src = self._files.get(rank) or self._opened(rank)
        try:
            return src.tree(src.raw.get("rng"))
        except CheckpointError:
            if src.whole:
                raise
            return self._whole(rank).raw.get("rng")

    def common(self) -> dict:
        """Rank 0's common record: step, extra, scaler state, skipped steps."""
        if self._common is None:
            data = read_verified(self.path, self.meta["common"])
            # "extra" is the caller's own data (any picklable object): a full unpickle
            self._common = load_bytes(data, weights_only=False)
        return self._common

    def keys(self, name: str) -> list[str]:
        return list(self.tensors[name]["keys"])

    def key_info(self, name: str, key: str) -> dict:
        """{"shape", "dtype"} of ``key`` of the global tensor ``name``; raises if not saved."""
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint {self.path} holds no tensor {name!r}")
        info = self.tensors[name]["keys"].get(key)
        if info is None:
            raise CheckpointError(f"checkpoint {self.path} holds no {key!r} for {name!r}")
        return info

    def gather(
        self,
        wants: dict[tuple[str, str], torch.Tensor | None],
        *,
        whole: bool = False,
        prefer: int | None = None,
    ) -> dict[tuple[str, str], torch.Tensor]:
        """{(name, key): 1-D values} at the global flat indices ``wants[name, key]`` (int64,
        sorted, no repeats; None: every element), in the saved dtype. Files are visited in rank
        order, ``prefer`` (this rank) first; each element comes from the first piece holding
        it. ``whole``: read every file needed in full. Raises if the pieces miss an element."""
        out, done, bad = {}, {}, {}
        for (name, key), idx in wants.items():
            info = self.key_info(name, key)
            n = math.prod(info["shape"])
            if idx is not None and idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= n):
                raise CheckpointError(f"indices outside {name!r} ({key}) of shape {info['shape']}")
            size = n if idx is None else idx.numel()
            out[name, key] = torch.zeros(size, dtype=dtype_from(info["dtype"]))
            done[name, key] = torch.zeros(size, dtype=torch.bool)
        ranks = range(len(self.meta["ranks"]))
        # tensors first, from this rank's file first; then one-element states (a step count
        # every file holds), from files already opened first
        scalar = [k for k in wants if k[1] in SCALAR_KEYS]
        passes = [
            ([k for k in wants if k[1] not in SCALAR_KEYS], lambda r: (r != prefer, r)),
            (scalar, lambda r: (r not in self._files, r != prefer, r)),
        ]
        for rank, keys in ((r, ks) for ks, by in passes for r in sorted(ranks, key=by)):
            entry = self.meta["ranks"][rank]
            listed = [k for k in keys if k[1] in entry["holds"].get(k[0], ())]
            mine = [k for k in listed if not bool(done[k].all())]
            needed = self._needed(entry, mine, wants, done)
            if not mine or needed == 0:
                if listed and not whole:
                    self._opened(rank)  # nothing to read, but it must be of this save
                continue
            try:
                self._take(rank, whole, needed, mine, wants, out, done, bad)
            except CheckpointError:
                if whole or rank not in self._files or self._files[rank].whole:
                    raise
                # a record failed its CRC-32: the whole file names what is wrong (sha256)
                self._take(rank, True, needed, mine, wants, out, done, bad)
        for (name, key), got in done.items():  # the first problem in the order asked
            if (name, key) in bad:
                raise CheckpointError(bad[name, key])
            if not bool(got.all()):
                raise CheckpointError(
                    f"checkpoint {self.path}: the saved pieces of {name!r} ({key}) do not cover "
                    f"it: {int((~got).sum())} of the {got.numel()} elements asked for are "
                    f"missing (a rank file lacks its shard)"
                )
        return out

    def _needed(self, entry: dict, mine, wants, done) -> int | None:
        """Bytes of the records (pieces) of the file ``entry`` that hold wanted, still missing
        elements, from the metadata's ``spans`` (None for a checkpoint saved without them)."""
        spans = entry.get("spans")
        if spans is None:
            return None
        total = 0
        for name, key in mine:
            pieces = spans.get(name, {}).get(key)
            if pieces is None:
                return None
            hit = wanted_pieces(pieces, wants[name, key], ~done[name, key]) > 0
            sizes = torch.tensor(piece_sizes(pieces), dtype=torch.int64)
            itemsize = dtype_from(self.tensors[name]["keys"][key]["dtype"]).itemsize
            total += int(sizes[hit].sum()) * itemsize
        return total

    def _take(self, rank: int, whole: bool, needed, mine, wants, out, done, bad) -> None:
        """Fill ``out`` from rank ``rank``'s pieces of the keys ``mine``, read whole when ``whole``
        or when the file's records holding ``needed`` bytes make up at least ``WHOLE`` of it, else
        record by record; ``bad``: {key: why} of pieces that do not fit their tensor."""
        entry = self.meta["ranks"][rank]
        big = needed is not None and needed >= WHOLE * entry["bytes"]
        src = self._whole(rank) if whole or big else self._opened(rank)
        plan = self._plan(src, entry, mine, wants, done, bad)
        if not src.whole:
            records = sum(p[1][1].untyped_storage().nbytes() for p in plan)
            if records >= WHOLE * entry["bytes"]:
                src = self._whole(rank)
                plan = self._plan(src, entry, mine, wants, done, bad)
        values = src.real([piece[1] for _, piece, _, _ in plan])
        for (k, _, pos, at), vals in zip(plan, values, strict=True):
            out[k][pos] = vals.reshape(-1)[at].to(out[k].dtype)
            done[k][pos] = True

    def _plan(self, src: _Source, entry: dict, mine, wants, done, bad) -> list:
        """[(key, piece, positions in wants[key], positions in the piece)] of ``src``'s pieces
        that hold wanted elements not yet ``done`` (their runs read, checked)."""
        todo = [k for k in mine if k in src.pieces and not bool(done[k].all())]
        pieces = [(k, piece) for k in todo for piece in src.pieces[k]]
        for piece, runs in zip(
            (p for _, p in pieces), src.real([p[0] for _, p in pieces]), strict=True
        ):
            piece[0] = runs
        plan, taken = [], {k: done[k].clone() for k in todo}
        for k, piece in pieces:
            why = self._misfit(k, piece, entry)
            if why is not None:
                bad.setdefault(k, why)
                continue
            pos, at = _match(piece[0], wants[k], taken[k])
            if pos.numel():
                taken[k][pos] = True
                plan.append((k, piece, pos, at))
        return plan

    def _misfit(self, k: tuple[str, str], piece: list, entry: dict) -> str | None:
        """Why a piece does not fit its global tensor, or None."""
        runs, values = piece
        shape = self.tensors[k[0]]["keys"][k[1]]["shape"]
        ok = runs.dim() == 2 and runs.shape[1] == 2 and runs.dtype == torch.int64
        if ok and runs.numel():
            starts, lengths = runs[:, 0], runs[:, 1]
            ok = bool((starts >= 0).all() and (lengths >= 0).all())
            ok = ok and int((starts + lengths).max()) <= math.prod(shape)
            ok = ok and int(lengths.sum()) == values.numel()
        if ok:
            return None
        return (
            f"checkpoint {self.path}: a piece of {k[0]!r} ({k[1]}) in {entry['file']} does not "
            f"fit its global shape {shape}"
        )

    def assemble(self, name: str, key: str) -> torch.Tensor:
        """The global tensor ``name`` / ``key`` (global shape) from every rank's pieces, files
        read whole; raises if they do not cover it."""
        if (name, key) not in self._full:
            shape = self.key_info(name, key)["shape"]
            flat = self.gather({(name, key): None}, whole=True)[name, key]
            self._full[name, key] = flat.view(shape)
        return self._full[name, key]

    def value(self, name: str) -> torch.Tensor:
        """The parameter's best value in fp32: the optimizer's fp32 master if saved, else the
        model's own copy."""
        keys = self.tensors[name]["keys"]
        return self.assemble(name, "param" if "param" in keys else "model").float()

    def release_files(self) -> None:
        """Drop the shard files read so far (kept for later gathers)."""
        self._files.clear()

    def release(self) -> None:
        """Drop cached files and tensors, and the read lock."""
        for cache in ("_files", "_full"):
            getattr(self, cache, {}).clear()
        if self._hold is not None:
            self._hold.close()
            self._hold = None
