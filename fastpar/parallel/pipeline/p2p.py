"""Point-to-point transfers between neighbouring pipeline stages (torch.distributed batched
isend / irecv).

Sends are posted and not waited on (their handles are kept until ``wait_sends``), so a stage
never blocks on a send and neighbours cannot deadlock whatever the schedule; a receive is
posted and waited for when its tensor is needed. Shapes and dtypes travel in a small header:
with ``static_shapes`` (the default) once per direction — later messages must match it — else
before every message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar.profiling import nvtx

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_MAX_DIMS = 8


class P2P:
    """Transfers to and from the global ranks ``prev`` / ``next`` (None at the pipeline ends)."""

    def __init__(self, prev: int | None, next: int | None, *, static_shapes: bool = True) -> None:
        self.prev, self.next, self.static_shapes = prev, next, static_shapes
        self._sent_meta: dict[int, tuple] = {}
        self._recv_meta: dict[int, tuple] = {}
        self._pending: list = []
        self.bytes_sent = 0

    def _header(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(
                f"pipeline messages support up to {_MAX_DIMS} dims and dtypes {_DTYPES}, got "
                f"{tuple(t.shape)} {t.dtype}"
            )
        h = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        h[0], h[1] = t.dim(), _DTYPES.index(t.dtype)
        h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return h.to(t.device)

    def send(self, t: torch.Tensor, peer: int) -> None:
        """Post the transfer of ``t`` to ``peer`` (not waited for)."""
        t = t.detach().contiguous()
        meta = (tuple(t.shape), t.dtype)
        ops = []
        if not self.static_shapes or peer not in self._sent_meta:
            ops.append(dist.P2POp(dist.isend, self._header(t), peer))
            self._sent_meta[peer] = meta
        elif self._sent_meta[peer] != meta:
            raise ValueError(
                f"a pipeline message to rank {peer} changed from {self._sent_meta[peer]} to {meta};"
                " pass static_shapes=False when activation shapes vary between micro-batches"
            )
        ops.append(dist.P2POp(dist.isend, t, peer))
        self.bytes_sent += t.numel() * t.element_size()
        with nvtx(f"send to {peer}"):
            self._pending += [(w, t) for w in dist.batch_isend_irecv(ops)]

    def recv(self, peer: int, device: torch.device) -> torch.Tensor:
        """Receive the next tensor from ``peer`` (waits for it)."""
        if not self.static_shapes or peer not in self._recv_meta:
            h = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, h, peer)]):
                w.wait()
            h = h.tolist()
            self._recv_meta[peer] = (tuple(h[2 : 2 + h[0]]), _DTYPES[h[1]])
        shape, dtype = self._recv_meta[peer]
        out = torch.empty(shape, dtype=dtype, device=device)
        with nvtx(f"recv from {peer}"):
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, peer)]):
                w.wait()
        return out

    def wait_sends(self) -> None:
        for w, _ in self._pending:
            w.wait()
        self._pending.clear()
