"""What this rank records of its communication, and its dump.

torch's flight recorder keeps every collective; fastpar's ring (``RING`` entries) what it lacks:
a group's kinds (``name_group``), an all-to-all's splits (``note_splits``), the pipeline's
messages (``note_p2p``). ``snapshot`` merges both, ``dump`` writes ``flight_rank<R>.json``
(docs/debugging.md, "What is recorded").
"""

from __future__ import annotations

import ast
import collections
import contextlib
import errno
import json
import mmap
import os
import pickle
import socket
import struct
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from fastpar.switches import Switch

ENV_VAR = "FASTPAR_FLIGHT"
DIR_VAR = "FASTPAR_FLIGHT_DIR"
TORCH_VAR = "TORCH_FR_BUFFER_SIZE"
RING = 1024  # fastpar's own entries (split notes, p2p) kept per rank
FRAMES = 4  # stack frames kept per collective (the innermost outside torch)
VERSION = 1


def _parse(raw: str | None) -> bool:
    word = (raw or "").strip().lower()
    if word in ("", "1", "on", "true", "yes"):
        return True
    if word in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{ENV_VAR}={raw!r} is not 1 or 0; set {ENV_VAR}=0 to turn it off, or unset")


SWITCH = Switch(ENV_VAR, _parse, lambda v: bool(v))


def enabled() -> bool:
    """Whether fastpar records and dumps (``FASTPAR_FLIGHT``, on unless 0)."""
    return SWITCH.get()


def torch_buffer() -> None:
    """Before the process group exists: with ``FASTPAR_FLIGHT=0`` and no ``TORCH_FR_BUFFER_SIZE``
    of the user's, turn torch's recorder off too (``TORCH_FR_BUFFER_SIZE=0``)."""
    if not enabled() and TORCH_VAR not in os.environ:
        os.environ[TORCH_VAR] = "0"


_lock = threading.RLock()  # held by a dump too: the launcher's exit waits for it (``settle``)
_ring: collections.deque = collections.deque(maxlen=RING)
_counts: dict[tuple, int] = {}
_kinds: dict[str, list[str]] = {}  # pg name -> the fastpar kinds that use it
_file: dict = {}  # the ring's copy on disk: {"map": mmap, "n": entries written}
SLOT = 512  # bytes a ring entry takes on disk


def open_ring(directory: str, rank: int) -> str | None:
    """Keep a copy of fastpar's ring in ``directory/ring_rank<R>.bin``, a memory-mapped file
    whose blocks are reserved first (docs/debugging.md says why). An existing file is reused and
    cleared, never shrunk (another live process mapping it would fault). Where the blocks cannot
    be had, the ring stays in memory only, no file is left, and one line on stderr says so.
    Returns None when the file is in use, else why not."""
    with _lock:
        _file.clear()
    path = os.path.join(directory, f"ring_rank{rank}.bin")
    size = RING * SLOT
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # (macOS) zeros written are blocks allocated
                os.pwrite(fd, bytes(size), 0)
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path)  # (an earlier run's: not this rank's side)
        why = f"{e.strerror or e} ({errno.errorcode.get(e.errno or 0, e.errno)})"
        print(
            f"fastpar: flight recorder: cannot reserve {path}: {why}; rank {rank} keeps its "
            "ring in memory only (if it dies, it leaves no ring file)",
            file=sys.stderr,
            flush=True,
        )
        return why
    m[:] = bytes(size)  # an earlier run's entries out
    with _lock:
        _file.update(map=m, n=0, pid=os.getpid())
    return None


def _append(entry: dict) -> None:  # under _lock
    _ring.append(entry)
    m = _file.get("map")
    if m is None or _file.get("pid") != os.getpid():
        return
    data = repr(entry).encode()  # a plain literal (ast.literal_eval reads it): cheaper than JSON
    if len(data) > SLOT - 4:
        data = repr(
            {k: v for k, v in entry.items() if k not in ("in_splits", "out_splits")}
        ).encode()
    at = (_file["n"] % RING) * SLOT
    m[at : at + 4 + len(data)] = struct.pack("<I", len(data)) + data
    _file["n"] += 1


def read_ring(path: str) -> list[dict]:
    """The entries of a ring file, oldest first."""
    out = []
    with open(path, "rb") as f:
        raw = f.read()
    for at in range(0, len(raw) - 4, SLOT):
        (size,) = struct.unpack("<I", raw[at : at + 4])
        if 0 < size <= SLOT - 4:
            with contextlib.suppress(ValueError, SyntaxError):
                out.append(ast.literal_eval(raw[at + 4 : at + 4 + size].decode()))
    return sorted(out, key=lambda e: e.get("n", 0))


def _pg_name(group) -> str:
    group = dist.group.WORLD if group is None else group
    try:
        return group.group_name
    except Exception:
        return "?"


def name_group(group, kinds: list[str]) -> None:
    """Mark ``group`` as the mesh's group of each of ``kinds`` (``ParallelMesh`` does)."""
    with _lock:
        have = _kinds.setdefault(_pg_name(group), [])
        have.extend(k for k in kinds if k not in have)


def _count(key: tuple) -> int:
    k = _counts.get(key, 0) + 1
    _counts[key] = k
    return k


def note(group, op: str, x: torch.Tensor, **extra) -> None:
    """Before fastpar's comm layer runs ``op`` on ``x`` over ``group``: its shape and dtype
    (nothing inside a region ``torch.compile`` traces: its collectives are torch's records)."""
    if torch.compiler.is_compiling() or not enabled():
        return
    name = _pg_name(group)
    with _lock:
        _append(
            {
                "kind": "collective",
                "group": name,
                "k": _count(("k", name)),
                "n": _count(("n",)),
                "op": op,
                "shape": list(x.shape),
                "dtype": str(x.dtype).removeprefix("torch."),
                "t": time.time(),
                **extra,
            }
        )


def note_splits(group, x: torch.Tensor, out_splits, in_splits) -> None:
    """Before an ``all_to_all_single`` of ``x`` over ``group``: its split sizes (None = even)."""
    if torch.compiler.is_compiling() or not enabled():
        return
    world = group.size() if group is not None else dist.get_world_size()
    rows = x.shape[0]
    even = [rows // world] * world if rows % world == 0 else None
    note(
        group,
        "all_to_all",
        x,
        in_splits=list(in_splits) if in_splits is not None else even,
        out_splits=list(out_splits) if out_splits is not None else even,
    )


def note_p2p(ops: list) -> None:
    """Before ``batch_isend_irecv``: each ``(dist.isend | dist.irecv, tensor, global peer, tag)``."""
    if torch.compiler.is_compiling() or not enabled():
        return
    now = time.time()
    with _lock:
        for op, t, peer, _tag in ops:
            what = "send" if op is dist.isend else "recv"
            _append(
                {
                    "kind": what,
                    "peer": int(peer),
                    "k": _count((what, int(peer))),
                    "n": _count(("n",)),
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "t": now,
                }
            )


_DTYPES = {
    "Float": "float32",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Double": "float64",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


_PASS_THROUGH = os.path.join("fastpar", "comm", "plain.py")
"""The module every non-differentiable collective passes through: never where it comes from."""


def _where(frames: list[dict]) -> list[str]:
    """The innermost ``FRAMES`` frames of a collective's stack outside torch, multiprocessing
    and ``fastpar/comm/plain.py``: "dir/file.py:line function" each."""
    torch_dir = os.path.dirname(torch.__file__)
    keep = []
    for f in frames or []:
        path = f.get("filename", "")
        if path.startswith(torch_dir) or "multiprocessing" in path or path.startswith("<"):
            continue
        if path.endswith(_PASS_THROUGH):
            continue
        short = "/".join(path.split("/")[-2:])
        keep.append(f"{short}:{f.get('line')} {f.get('name')}")
        if len(keep) == FRAMES:
            break
    return keep


def torch_trace() -> dict | None:
    """torch's flight recorder's dump, unpickled (None where this torch has none)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        return pickle.loads(_dump_fr_trace())
    except Exception:
        return None


def _groups() -> dict[str, dict]:
    out: dict[str, dict] = {}
    with contextlib.suppress(Exception):
        from torch.distributed.distributed_c10d import _world

        for pg, name in list(_world.pg_names.items()):
            with contextlib.suppress(Exception):
                ranks = dist.get_process_group_ranks(pg)
                out[name] = {"ranks": ranks, "desc": getattr(pg, "group_desc", "")}
    with _lock:
        for name, kinds in _kinds.items():
            out.setdefault(name, {"ranks": [], "desc": ""})["kinds"] = list(kinds)
    return out


def _collectives(trace: dict | None) -> list[dict]:
    out = []
    for e in (trace or {}).get("entries", []):
        if e.get("is_p2p") or e.get("time_created_ns", 0) / 1e9 < _since[0]:
            continue
        out.append(
            {
                "group": str(e["process_group"][0]),
                "seq": int(e["collective_seq_id"]),
                "op": str(e["profiling_name"]).split(":")[-1],
                "in": e.get("input_sizes", []),
                "in_dtypes": [_DTYPES.get(d, d) for d in e.get("input_dtypes", [])],
                "out": e.get("output_sizes", []),
                "out_dtypes": [_DTYPES.get(d, d) for d in e.get("output_dtypes", [])],
                "done": bool(e.get("retired")),
                "t": e.get("time_created_ns", 0) / 1e9,
                "where": _where(e.get("frames", [])),
            }
        )
    return out


def _from_notes(ring: list[dict]) -> list[dict]:
    """Without torch's recorder (an older torch): fastpar's notes as the collectives, numbered
    by their order in each group (the comm layer's collectives only)."""
    return [
        {
            "group": n["group"],
            "seq": n["k"],
            "op": n["op"],
            "in": [n["shape"]],
            "in_dtypes": [n["dtype"]],
            "out": [],
            "out_dtypes": [],
            "done": True,
            "t": n["t"],
            "where": [],
        }
        for n in ring
        if n.get("kind") == "collective"
    ]


def snapshot(reason: str = "") -> dict:
    """This rank's records as one JSON-able dict (the dump's content). Its ``time`` is taken
    before the records are read: nothing this rank entered after it is in them."""
    taken = time.time()
    trace = torch_trace()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    status = {
        str(k): {
            "enqueued": v.get("last_enqueued_collective"),
            "done": v.get("last_completed_collective"),
        }
        for k, v in ((trace or {}).get("pg_status") or {}).items()
    }
    with _lock:
        ring = list(_ring)
    frame = sys._current_frames().get(threading.main_thread().ident)
    return {
        "fastpar_flight": VERSION,
        "rank": rank,
        "world_size": world,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": taken,
        "reason": reason,
        "torch_recorder": trace is not None,
        "groups": _groups(),
        "status": status,
        "collectives": _collectives(trace) if trace is not None else _from_notes(ring),
        "ring": ring,
        "stack": traceback.format_stack(frame)[-12:] if frame is not None else [],
    }


def dump(directory: str, reason: str = "") -> str | None:
    """Write this rank's ``snapshot`` to ``directory/flight_rank<R>.json`` (atomically: a reader
    never sees half a file); returns the path (None when recording is off, or when the file could
    not be written: a full disk, which one line on stderr names; nothing is left behind)."""
    if not enabled():
        return None
    with _lock:
        data = snapshot(reason)
        path = os.path.join(directory, f"flight_rank{data['rank']}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            why = f"{e.strerror or e} ({errno.errorcode.get(e.errno or 0, e.errno)})"
            print(
                f"fastpar: flight recorder: rank {data['rank']} could not write {path}: {why}",
                file=sys.stderr,
                flush=True,
            )
            return None
        return path


def settle(timeout: float = 5.0) -> None:
    """Wait (up to ``timeout`` s) for a dump another thread is writing (before ``os._exit``)."""
    if _lock.acquire(timeout=timeout):
        _lock.release()


def reset() -> None:
    """Start this rank's records afresh for the next run in the same process (the pool of live
    ranks: ``fastpar.launch.pool``): fastpar's ring, its counts and group kinds are forgotten
    (a mesh names its groups again), and a dump leaves out torch's records of collectives
    created before now (their groups' sequence numbers go on)."""
    with _lock:
        _ring.clear()
        _counts.clear()
        _file.clear()
        _kinds.clear()
        _since[0] = time.time()


_since = [0.0]  # torch's records older than this are a previous run's (``reset``)
