"""Point-to-point transfers between neighbouring pipeline stages (torch.distributed batched
isend / irecv): tensor or tuple messages, unwaited sends, early receives, a channel per tag
(docs/pipelines.md, "Point-to-point")."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastpar.comm import plain
from fastpar.comm.checks import WIRE_DTYPES as _DTYPES
from fastpar.profiling import nvtx

_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # one tensor: [ndim, dtype, shape...]; a tuple: [-1, slots, 0...]
_SLOT = 3 + _MAX_DIMS  # one slot of a tuple: [ndim (-1: None), dtype, requires_grad, shape...]

Message = torch.Tensor | tuple  # a tuple of torch.Tensor | None


@dataclass(frozen=True)
class _Slots:
    """What a tuple message holds: per slot None or (shape, dtype, requires_grad)."""

    slots: tuple

    def __str__(self) -> str:
        def one(s) -> str:
            return "None" if s is None else f"{s[0]} {s[1]}" + (" requires_grad" if s[2] else "")

        return "(" + ", ".join(one(s) for s in self.slots) + ")"


def _check(t: torch.Tensor) -> None:
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(
            f"pipeline messages support up to {_MAX_DIMS} dims and dtypes {list(_DTYPES)}, got "
            f"{tuple(t.shape)} {t.dtype}"
        )


def tuple_message(msg) -> tuple:
    """``msg`` as a tuple message (a tuple or list of tensors and Nones), or a clear TypeError."""
    if not isinstance(msg, tuple | list) or not all(
        t is None or isinstance(t, torch.Tensor) for t in msg
    ):
        held = (
            f" holding {[type(t).__name__ for t in msg]}" if isinstance(msg, tuple | list) else ""
        )
        raise TypeError(
            "a pipeline stage must return a tensor or a tuple of tensors (None allowed), got "
            f"{type(msg).__name__}{held}"
        )
    return tuple(msg)


class P2P:
    """Transfers to and from the global ranks ``prev`` / ``next`` (None at the pipeline ends).
    ``early_recvs``: whether ``post_recv`` posts (None: for CPU tensors, i.e. gloo)."""

    def __init__(
        self,
        prev: int | None,
        next: int | None,
        *,
        static_shapes: bool = True,
        early_recvs: bool | None = None,
    ) -> None:
        self.prev, self.next, self.static_shapes = prev, next, static_shapes
        self.early_recvs = early_recvs
        self._sent_meta: dict[tuple[int, int], object] = {}
        self._recv_meta: dict[tuple[int, int], object] = {}
        self._early: dict[tuple[int, int], deque] = {}  # posted receives per channel, in order
        self._pending: list = []
        self.bytes_sent = 0
        self.send_s = 0.0  # host seconds posting sends and early receives
        self.recv_s = 0.0  # host seconds in recv: posting if not early, waiting for the data

    def _header(self, t: torch.Tensor) -> torch.Tensor:
        _check(t)
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[0], h[1] = t.dim(), _DTYPES.index(t.dtype)
        h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return h.to(t.device)

    def _header_ops(self, meta, peer: int, headers, tag: int = 0) -> list:
        """The header sends (if this message needs them), after checking ``meta`` against the
        first message's on this channel under static shapes."""
        key = (peer, tag)
        if not self.static_shapes or key not in self._sent_meta:
            self._sent_meta[key] = meta
            return [(dist.isend, h, peer, tag) for h in headers()]
        if self._sent_meta[key] != meta:
            raise ValueError(
                f"a pipeline message to rank {peer} changed from {self._sent_meta[key]} to {meta};"
                " pass static_shapes=False when activation shapes vary between micro-batches"
            )
        return []

    def _timed(self, seconds: str, fn, *args):
        """``fn(*args)``, its host time added to the counter ``seconds`` (even if it raises)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            setattr(self, seconds, getattr(self, seconds) + time.perf_counter() - t0)

    def _post(self, ops: list, peer: int, data: list[torch.Tensor]) -> None:
        self.bytes_sent += sum(t.numel() * t.element_size() for t in data)
        if ops:
            with nvtx(f"send to {peer}"):
                self._pending += [(w, data) for w in plain.start_p2p(ops)]

    def send(self, msg: Message, peer: int, *, requires_grad=None, tag: int = 0) -> None:
        """Post the transfer of ``msg`` to ``peer`` (not waited for). For a tuple,
        ``requires_grad`` (one bool per slot) overrides the slots' own flags, e.g. for an
        output computed under ``torch.no_grad`` whose recomputation will require grad."""
        self._timed("send_s", self._send, msg, peer, requires_grad, tag)

    def _send(self, msg: Message, peer: int, requires_grad, tag: int) -> None:
        if isinstance(msg, torch.Tensor):
            t = msg.detach().contiguous()
            meta = (tuple(t.shape), t.dtype)
            ops = self._header_ops(meta, peer, lambda: [self._header(t)], tag)
            ops.append((dist.isend, t, peer, tag))
            self._post(ops, peer, [t])
            return
        msg = tuple_message(msg)
        flags = [t is not None and t.requires_grad for t in msg]
        if requires_grad is not None:
            if len(requires_grad) != len(msg):
                raise ValueError(
                    f"got {len(requires_grad)} requires_grad flags for {len(msg)} slots"
                )
            flags = [bool(f) for f in requires_grad]
        tensors = [None if t is None else t.detach().contiguous() for t in msg]
        for j, (t, f) in enumerate(zip(tensors, flags, strict=True)):
            if t is not None:
                _check(t)
            if f and (t is None or not t.is_floating_point()):
                what = "None" if t is None else t.dtype
                raise ValueError(f"slot {j} ({what}) cannot require grad: only floating slots can")
        meta = _Slots(
            tuple(
                None if t is None else (tuple(t.shape), t.dtype, f)
                for t, f in zip(tensors, flags, strict=True)
            )
        )
        data = [t for t in tensors if t is not None and t.numel()]
        ops = self._header_ops(meta, peer, lambda: self._tuple_headers(meta, tensors), tag)
        ops += [(dist.isend, t, peer, tag) for t in data]
        self._post(ops, peer, data)

    @staticmethod
    def _tuple_headers(meta: _Slots, tensors: list) -> list[torch.Tensor]:
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        first = torch.zeros(_HEADER, dtype=torch.int64)
        first[0], first[1] = -1, len(meta.slots)
        rows = torch.zeros(len(meta.slots), _SLOT, dtype=torch.int64)
        for row, s in zip(rows, meta.slots, strict=True):
            if s is None:
                row[0] = -1
                continue
            shape, dtype, flag = s
            row[0], row[1], row[2] = len(shape), _DTYPES.index(dtype), int(flag)
            row[3 : 3 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        return [first.to(device), rows.flatten().to(device)]

    def _recv_header(self, peer: int, device: torch.device, tag: int):
        h = torch.empty(_HEADER, dtype=torch.int64, device=device)
        self._wait_recv([h], peer, tag)
        h = h.tolist()
        if h[0] >= 0:
            return (tuple(h[2 : 2 + h[0]]), _DTYPES[h[1]])
        rows = torch.empty(h[1] * _SLOT, dtype=torch.int64, device=device)
        if h[1]:
            self._wait_recv([rows], peer, tag)
        slots = []
        for r in rows.view(h[1], _SLOT).tolist():
            slots.append(None if r[0] < 0 else (tuple(r[3 : 3 + r[0]]), _DTYPES[r[1]], bool(r[2])))
        return _Slots(tuple(slots))

    @staticmethod
    def _wait_recv(bufs: list[torch.Tensor], peer: int, tag: int = 0) -> None:
        if bufs:
            for w in plain.start_p2p([(dist.irecv, b, peer, tag) for b in bufs]):
                w.wait()

    @staticmethod
    def _buffers(meta, device: torch.device) -> tuple[Message, list[torch.Tensor]]:
        """Empty tensors for a message of ``meta``, and those that a transfer fills."""
        if not isinstance(meta, _Slots):
            out = torch.empty(meta[0], dtype=meta[1], device=device)
            return out, [out]
        msg = tuple(
            None if s is None else torch.empty(s[0], dtype=s[1], device=device) for s in meta.slots
        )
        return msg, [t for t in msg if t is not None and t.numel()]

    @staticmethod
    def _flag(msg: Message, meta) -> Message:
        if isinstance(meta, _Slots):
            for t, s in zip(msg, meta.slots, strict=True):
                if s is not None and s[2]:
                    t.requires_grad_(True)
        return msg

    def post_recv(self, peer: int, device: torch.device, *, tag: int = 0) -> bool:
        """Post the receive of the next message from ``peer`` on channel ``tag`` now (not
        waited for), when its shapes are known and early receives are on for ``device``;
        the matching ``recv`` then waits for it. Returns whether it was posted (if not,
        ``recv`` posts it itself; post nothing later on this channel before that ``recv``)."""
        return self._timed("send_s", self._post_recv, peer, device, tag)

    def _post_recv(self, peer: int, device: torch.device, tag: int) -> bool:
        key = (peer, tag)
        early = device.type == "cpu" if self.early_recvs is None else self.early_recvs
        if not early or not self.static_shapes or key not in self._recv_meta:
            return False
        meta = self._recv_meta[key]
        msg, bufs = self._buffers(meta, device)
        ops = [(dist.irecv, b, peer, tag) for b in bufs]
        self._early.setdefault(key, deque()).append(
            (msg, meta, plain.start_p2p(ops) if ops else [])
        )
        return True

    def posted_recvs(self) -> int:
        """Receives posted early and not yet taken by ``recv``."""
        return sum(len(q) for q in self._early.values())

    def recv(self, peer: int, device: torch.device, *, tag: int = 0) -> Message:
        """Receive the next message from ``peer`` on channel ``tag`` (waits for it): a tensor,
        or a tuple whose slots that were sent requiring grad are leaves that require grad."""
        return self._timed("recv_s", self._recv, peer, device, tag)

    def _recv(self, peer: int, device: torch.device, tag: int) -> Message:
        key = (peer, tag)
        if self._early.get(key):
            msg, meta, works = self._early[key].popleft()
            with nvtx(f"recv from {peer}"):
                for w in works:
                    w.wait()
            return self._flag(msg, meta)
        if not self.static_shapes or key not in self._recv_meta:
            self._recv_meta[key] = self._recv_header(peer, device, tag)
        meta = self._recv_meta[key]
        msg, bufs = self._buffers(meta, device)
        with nvtx(f"recv from {peer}"):
            self._wait_recv(bufs, peer, tag)
        return self._flag(msg, meta)

    def wait_sends(self) -> None:
        for w, _ in self._pending:
            w.wait()
        self._pending.clear()
