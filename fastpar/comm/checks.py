"""Cross-rank agreement checks: do all ranks of a group pass the same shapes and ids?

``check_same`` (the debug check, docs/development.md "Cross-rank checks") all-reduces a hash of
a summary of ``fields`` and, only when the ranks differ, all-gathers the summaries so every rank
raises the same ``ValueError`` naming each rank's value. ``digest`` condenses an integer tensor
on its device (no sync); ``raise_if_disagree`` raises from values the caller gathered itself.
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fastpar.comm.collectives import group_size
from fastpar.profiling import nvtx

SLOTS = 64  # int64 elements each rank sends: the same for every call, so a call never aborts
MAX_DIMS = 8  # dimensions of a shape kept apart; more are folded into the last
DIGEST_BITS = 48
WIRE_DTYPES = (  # a dtype's code on the wire (here and in pipeline messages) is its index
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)

Field = int | float | str | torch.dtype | Sequence[int] | torch.Tensor


def digest(ids: torch.Tensor) -> torch.Tensor:
    """``Σ (id_i + 1)·(2i + 1) mod 2^48`` over the flattened integer tensor: 0-dim int64 on its
    device, no host sync. The weights are odd, so changing any single id changes the digest;
    reordering or changing several collides with chance about 2^-48."""
    flat = ids.reshape(-1).long()
    weights = torch.arange(1, 2 * flat.numel() + 1, 2, device=flat.device)
    return ((flat + 1) * weights).sum() & ((1 << DIGEST_BITS) - 1)


def _encode(value: Field) -> list[int] | None:
    """The slots of one field (None: a device tensor, filled in on the device)."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, torch.dtype):
        return [
            WIRE_DTYPES.index(value) if value in WIRE_DTYPES else zlib.crc32(str(value).encode())
        ]
    if isinstance(value, bool | int):
        return [int(value)]
    if isinstance(value, float):
        return [struct.unpack("<q", struct.pack("<d", value))[0]]
    if isinstance(value, str):
        return [zlib.crc32(value.encode())]
    dims = [int(d) for d in value]
    kept = (
        [*dims[: MAX_DIMS - 1], math.prod(dims[MAX_DIMS - 1 :])] if len(dims) > MAX_DIMS else dims
    )
    return [len(dims), *kept, *[0] * (MAX_DIMS - len(kept))]


def _decode(mine: Field, slots: list[int]) -> str:
    """How one rank's ``slots`` of a field read, given this rank's own value of it."""
    if isinstance(mine, torch.Tensor):
        return f"digest {slots[0]:#014x}"
    if isinstance(mine, torch.dtype):
        code = slots[0]
        return str(WIRE_DTYPES[code]) if 0 <= code < len(WIRE_DTYPES) else f"dtype #{code}"
    if isinstance(mine, float):
        return repr(struct.unpack("<d", struct.pack("<q", slots[0]))[0])
    if isinstance(mine, str):
        return repr(mine) if slots[0] == zlib.crc32(mine.encode()) else "another value"
    if isinstance(mine, bool | int):
        return str(slots[0])
    ndim, dims = slots[0], slots[1 : 1 + min(slots[0], MAX_DIMS)]
    if ndim > MAX_DIMS:
        return f"({', '.join(map(str, dims[:-1]))}, ... {ndim} dims)"
    return str(tuple(dims))


def _rank_names(group: dist.ProcessGroup | None, ranks: list[int]) -> str:
    def name(r: int) -> str:
        if group is None or not dist.is_initialized():
            return str(r)
        g = dist.get_global_rank(group, r)
        return str(r) if g == r else f"{r} (global {g})"

    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(name(r) for r in ranks)


def raise_if_disagree(
    what: str, per_rank: dict[str, list[str]], group: dist.ProcessGroup | None, hint: str
) -> None:
    """Raise ``ValueError`` naming every field whose value (a string per group rank) differs.

    Called with the same values on every rank, it raises the same error on every rank.
    """
    parts = []
    for name, values in per_rank.items():
        if len(set(values)) < 2:
            continue
        by_value: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(r)
        parts.append(
            f"{name} " + ", ".join(f"{v} on {_rank_names(group, rs)}" for v, rs in by_value.items())
        )
    if parts:
        world = len(next(iter(per_rank.values())))
        raise ValueError(
            f"{what}: the {world} ranks of the group disagree: {'; '.join(parts)}; {hint}"
        )


def check_same(
    what: str,
    fields: dict[str, Field],
    group: dist.ProcessGroup | None,
    device: torch.device,
    hint: str = "every rank of a tensor-parallel group must pass the same shapes",
) -> None:
    """Compare ``fields`` across ``group`` and raise on every rank where any differs.

    ``fields``: ints, floats, strings, dtypes, shapes, or 0-dim int64 device tensors (digests).
    ``what`` names the call site; it must read the same on every rank (no rank ids in it).
    Nothing happens on a group of one rank. Inside compiled code (``torch.compile``) the check
    runs eagerly, as one graph break: dynamo cannot trace its host-side packing.
    """
    if group_size(group) == 1:
        return
    if torch.compiler.is_compiling():
        global _EAGER_CHECK
        if _EAGER_CHECK is None:  # made at first use: torch.compiler.disable imports dynamo
            _EAGER_CHECK = torch.compiler.disable(_check_same)
        return _EAGER_CHECK(what, fields, group, device, hint)
    return _check_same(what, fields, group, device, hint)


_EAGER_CHECK = None


def _check_same(what, fields, group, device, hint) -> None:
    world = group_size(group)
    slots = [zlib.crc32(f"{what}|{'|'.join(fields)}".encode())]
    on_device = []
    for value in fields.values():
        encoded = _encode(value)
        if encoded is None:
            on_device.append((len(slots), value))
            encoded = [0]
        slots.extend(encoded)
    if len(slots) > SLOTS:
        raise ValueError(f"check_same({what!r}): {len(slots)} slots, at most {SLOTS}")
    slots += [0] * (SLOTS - len(slots))
    packed = struct.pack(f"<{SLOTS}q", *slots)
    key = int.from_bytes(hashlib.blake2b(packed, digest_size=7).digest(), "little")  # < 2^56
    key = torch.full((), key, dtype=torch.int64, device=device)
    for k, (_, value) in enumerate(on_device):  # digests < 2^48: the sum stays below 2^62
        key = key + (2 * k + 3) * value.to(device=device, dtype=torch.int64).reshape(())
    pair = torch.stack([key, -key])
    with nvtx("debug check all_reduce"):
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group)
    top, neg_bottom = pair.tolist()
    if top == -neg_bottom:
        return
    vec = torch.tensor(slots, dtype=torch.int64).to(device)
    for index, value in on_device:
        vec[index] = value.to(device=device, dtype=torch.int64).reshape(())
    out = torch.empty(world * SLOTS, dtype=torch.int64, device=device)
    with nvtx("debug check all_gather"):
        dist.all_gather_into_tensor(out, vec, group=group)
    _raise_named(what, fields, slots[0], out.view(world, SLOTS).tolist(), group, hint)


def _raise_named(
    what: str,
    fields: dict[str, Field],
    call: int,
    rows: list[list[int]],
    group: dist.ProcessGroup | None,
    hint: str,
) -> None:
    """Raise the error for gathered summaries ``rows`` (one per rank) that differ."""
    if any(row[0] != call for row in rows):
        here = [r for r, row in enumerate(rows) if row[0] == call]
        others = [r for r in range(len(rows)) if r not in here]
        raise ValueError(
            f"{what}: the ranks of the group are not at the same call: {_rank_names(group, here)} "
            f"in {what}, {_rank_names(group, others)} in another one; every rank must run the "
            "same layers in the same order"
        )
    per_rank: dict[str, list[str]] = {}
    start = 1
    for name, value in fields.items():
        width = len(_encode(value) or [0])
        per_rank[name] = [_decode(value, row[start : start + width]) for row in rows]
        start += width
    raise_if_disagree(what, per_rank, group, hint)
