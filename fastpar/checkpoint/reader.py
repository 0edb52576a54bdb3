"""``CheckpointReader``: verified access to a saved checkpoint's global tensors, whatever the
layout it was saved under."""

from __future__ import annotations

import math
import os

import torch

from fastpar.checkpoint.format import (
    CheckpointError,
    check_same_save,
    load_bytes,
    read_metadata,
    read_verified,
)
from fastpar.checkpoint.lock import hold_for_reading
from fastpar.checkpoint.state import decode_runs


def dtype_from(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


class CheckpointReader:
    """Opens ``path`` after checking its marker, metadata and file sizes; rank files are read
    (and checksummed) only when a tensor they hold is asked for.

    ``tensors``: {global name: {"shape", "dtype", "sharding", "keys": {key: {"shape",
    "dtype"}}}}; ``layout``: how it was saved; ``assemble(name, key)``: the global tensor.
    Until ``release()`` it holds a shared lock on the checkpoint, so ``--keep-last`` pruning
    never deletes it while it is read.
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
        self._files: dict[int, dict] = {}
        self._full: dict[tuple[str, str], torch.Tensor] = {}
        self._common: dict | None = None

    def rank_data(self, rank: int) -> dict:
        """The parsed shard file of ``rank``: {"pieces": {(name, key): [(runs, values)]},
        "rng": ..., ...}."""
        if rank not in self._files:
            entry = self.meta["ranks"][rank]
            raw = load_bytes(read_verified(self.path, entry))
            check_same_save(self.path, f"the shard {entry['file']}", raw, self.meta)
            pieces: dict[tuple[str, str], list] = {}
            for p in raw["pieces"]:
                pieces.setdefault((p["name"], p["key"]), []).append((p["runs"], p["values"]))
            raw["pieces"] = pieces
            self._files[rank] = raw
        return self._files[rank]

    def common(self) -> dict:
        """Rank 0's common record: step, extra, scaler state, skipped steps."""
        if self._common is None:
            data = read_verified(self.path, self.meta["common"])
            # "extra" is the caller's own data (any picklable object): a full unpickle
            self._common = load_bytes(data, weights_only=False)
        return self._common

    def keys(self, name: str) -> list[str]:
        return list(self.tensors[name]["keys"])

    def assemble(self, name: str, key: str) -> torch.Tensor:
        """The global tensor ``name`` / ``key`` (global shape) from every rank's pieces;
        raises if they do not cover it."""
        if (name, key) in self._full:
            return self._full[name, key]
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint {self.path} holds no tensor {name!r}")
        info = self.tensors[name]["keys"].get(key)
        if info is None:
            raise CheckpointError(f"checkpoint {self.path} holds no {key!r} for {name!r}")
        shape, dtype = info["shape"], dtype_from(info["dtype"])
        numel = math.prod(shape)
        full = torch.zeros(numel, dtype=dtype)
        covered = torch.zeros(numel, dtype=torch.bool)
        for rank, entry in enumerate(self.meta["ranks"]):
            if key not in entry["holds"].get(name, ()):
                continue
            for runs, values in self.rank_data(rank)["pieces"].get((name, key), ()):
                idx = decode_runs(runs)
                if idx.numel() != values.numel() or (idx.numel() and int(idx.max()) >= numel):
                    raise CheckpointError(
                        f"checkpoint {self.path}: a piece of {name!r} ({key}) in "
                        f"{entry['file']} does not fit its global shape {shape}"
                    )
                full[idx] = values.to(dtype)
                covered[idx] = True
        if not bool(covered.all()):
            missing = int((~covered).sum())
            raise CheckpointError(
                f"checkpoint {self.path}: the saved pieces of {name!r} ({key}) do not cover it: "
                f"{missing} of {numel} elements are missing (a rank file lacks its shard)"
            )
        out = full.view(shape)
        self._full[name, key] = out
        return out

    def value(self, name: str) -> torch.Tensor:
        """The parameter's best value in fp32: the optimizer's fp32 master if saved, else the
        model's own copy."""
        keys = self.tensors[name]["keys"]
        return self.assemble(name, "param" if "param" in keys else "model").float()

    def release_files(self) -> None:
        """Drop the parsed shard files (kept for ``assemble``)."""
        self._files.clear()

    def release(self) -> None:
        """Drop cached files and tensors, and the read lock."""
        for cache in ("_files", "_full"):
            getattr(self, cache, {}).clear()
        if self._hold is not None:
            self._hold.close()
            self._hold = None
