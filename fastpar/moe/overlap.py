"""All-to-all overlapped with expert compute: the MoE layer's token buffer in K chunks, over the
extension's asynchronous all-to-all or ``torch.distributed``'s (``set_transport``), forward and
backward (docs/moe.md, "Expert-parallel transport")."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar.comm import plain
from fastpar.flight.record import note_splits
from fastpar.ops import backend
from fastpar.switches import Setting, Switch, choice

TRANSPORTS = ("python", "extension")
TRANSPORT_ENV = "FASTPAR_MOE_TRANSPORT"


def _check_transport(name: str) -> str:
    if name not in TRANSPORTS:
        raise ValueError(f"transport {name!r} is not 'python' or 'extension'")
    return name


_TRANSPORT = Switch(TRANSPORT_ENV, choice(TRANSPORT_ENV, TRANSPORTS, auto=None), _check_transport)


_EXTENSION: list[bool] = []
"""Whether fastpar._C's ops are usable, once known (a plain memo: dynamo does not honour
functools.cache, it traces the wrapped function)."""


def _extension_ops() -> bool:
    """Whether fastpar._C is built; registers the ops' fake (meta) implementations once, so
    torch.compile and torch.library.opcheck can trace them."""
    if not _EXTENSION:
        _EXTENSION.append(_register_extension_ops())
    return _EXTENSION[0]


# A constant of the process: torch.compile calls it while tracing and uses the answer, instead of
# tracing the probe (whose file read and import would break the graph). The mark is the one
# torch.compiler.assume_constant_result sets, set by hand because calling that imports
# torch._dynamo, which ``import fastpar`` must not.
_extension_ops._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _register_extension_ops() -> bool:
    ok, _ = backend.extension_status()
    if not (ok and hasattr(torch.ops.fastpar, "all_to_all_start")):
        return False

    @torch.library.register_fake("fastpar::pack_chunk")
    def _pack_fake(full, c0, c1):
        return full.new_empty((full.shape[0], c1 - c0, full.shape[2]))

    @torch.library.register_fake("fastpar::unpack_chunk")
    def _unpack_fake(full, chunk, c0):
        return None

    def received(input, output_split_sizes):
        rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
        return input.new_empty((rows, *input.shape[1:]))

    @torch.library.register_fake("fastpar::all_to_all_start")
    def _start_fake(input, output_split_sizes, input_split_sizes, group_name):
        return input.new_empty((1,), dtype=torch.uint8)  # the ticket

    @torch.library.register_fake("fastpar::all_to_all_wait")
    def _wait_fake(ticket, input, output_split_sizes):
        return received(input, output_split_sizes)

    @torch.library.register_fake("fastpar::all_to_all")
    def _sync_fake(input, output_split_sizes, input_split_sizes, group_name):
        return received(input, output_split_sizes)

    # A collective is never dead code: a traced graph keeps every start and wait that eager
    # would issue, even where their results go unused (every rank must take part).
    for op in ("all_to_all_start", "all_to_all_wait", "all_to_all"):
        torch.fx.node.has_side_effect(getattr(torch.ops.fastpar, op).default)
    return True


class set_transport(Setting):  # lower case: a call and a context manager, like debug_checks
    """Force the overlapped MoE layer's all-to-all onto ``name``: "python"
    (``torch.distributed``) or "extension" (``fastpar._C``); ``None``: back to
    ``FASTPAR_MOE_TRANSPORT``, else the extension when it is built. For the rest of the process,
    or, as a context manager, only inside the block."""

    SWITCH = _TRANSPORT


def transport() -> str:
    """ "extension" or "python": which all-to-all the overlapped MoE layer uses here."""
    forced = _TRANSPORT.get()
    if forced == "python":
        return "python"
    if forced == "extension":
        if not _extension_ops():
            where = "set_transport" if _TRANSPORT.overridden else f"{TRANSPORT_ENV}=extension"
            raise RuntimeError(
                f"{where} asks for the extension transport, but fastpar._C is not built: build "
                "it (pip install -e .) or use the python transport"
            )
        return "extension"
    return "extension" if _extension_ops() else "python"


class _Pending:
    """An all-to-all in flight: ``wait()`` returns the received rows. The extension's transfer is
    keyed by its ticket (``ticket``: its op hands out the rows only once they have arrived); the
    python transport's by a ``Work`` writing into ``out``. Dropped unwaited, neither leaks."""

    def __init__(self, out=None, work=None, keep=None, ticket=None, out_splits=None):
        self.out, self.work, self.keep = out, work, keep
        self.ticket, self.out_splits = ticket, out_splits

    def wait(self) -> torch.Tensor:
        if self.ticket is not None:
            self.out = torch.ops.fastpar.all_to_all_wait(self.ticket, self.keep, self.out_splits)
        elif self.work is not None:
            self.work.wait()
        self.work = self.keep = self.ticket = None
        return self.out


def start_all_to_all(x: torch.Tensor, group, out_splits, in_splits, kind: str) -> _Pending:
    """Start an all-to-all of the rows of ``x`` over ``kind`` (``transport()``'s answer);
    ``.wait()`` returns the received rows."""
    x = x.contiguous()
    note_splits(group, x, out_splits, in_splits)  # the flight recorder's record of the splits
    if kind == "extension":
        g = group if group is not None else dist.distributed_c10d._get_default_group()
        out_splits = out_splits or []
        ticket = torch.ops.fastpar.all_to_all_start(x, out_splits, in_splits or [], g.group_name)
        return _Pending(keep=x, ticket=ticket, out_splits=out_splits)
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = plain.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    return _Pending(out, work=work, keep=x)


def _pack(buf: torch.Tensor, c0: int, c1: int, kind: str) -> torch.Tensor:
    if kind == "extension":
        return torch.ops.fastpar.pack_chunk(buf.contiguous(), c0, c1)
    return buf.narrow(1, c0, c1 - c0).contiguous()


def _unpack(buf: torch.Tensor, chunk: torch.Tensor, c0: int, kind: str) -> None:
    if kind == "extension":
        torch.ops.fastpar.unpack_chunk(buf, chunk.contiguous(), c0)
    else:
        buf.narrow(1, c0, chunk.shape[1]).copy_(chunk)


def _split(n: int, k: int) -> list[int]:
    """n rows in k parts. For k >= 3 the first and the last part are half the size of the
    others (weights 1, 2, ..., 2, 1): the first dispatch and the last combine are the only
    all-to-alls with no compute to hide behind, so shrinking them raises the hideable share of
    the all-to-all time from 1 - 1/k to 1 - 1/(2k - 2) (75 % -> 83 % at k = 4), while each
    middle chunk's compute still covers the transfers in flight beside it whenever compute is
    at least as long as communication. Rounding puts leftover rows on the middle parts."""
    if k < 3:
        return [n // k + (1 if j < n % k else 0) for j in range(k)]
    weights = [1] + [2] * (k - 2) + [1]
    total = sum(weights)
    sizes = [n * w // total for w in weights]
    for j in range(n - sum(sizes)):  # fewer than k leftover rows
        sizes[1 + j % (k - 2)] += 1
    return sizes


class CapacityChunks:
    """Chunks of an [E, C, H] buffer along C; equal all-to-all splits. ``transport`` is chosen
    once, here (one layer call)."""

    def __init__(self, experts: int, capacity: int, hidden: int, ep: int, k: int):
        self.e, self.c, self.h, self.ep, self.k = experts, capacity, hidden, ep, k
        self.transport = transport()
        self.e_loc = experts // ep
        sizes = _split(capacity, k)
        self.bounds = [(sum(sizes[:j]), sum(sizes[: j + 1])) for j in range(k) if sizes[j]]
        self.in_splits = self.out_splits = [None] * len(self.bounds)

    def take(self, buf: torch.Tensor, j: int) -> torch.Tensor:
        c0, c1 = self.bounds[j]
        return _pack(buf, c0, c1, self.transport).view(-1, self.h)

    def put(self, buf: torch.Tensor, j: int, rows: torch.Tensor) -> None:
        c0, c1 = self.bounds[j]
        _unpack(buf, rows.view(self.e, c1 - c0, self.h), c0, self.transport)

    def to_compute(self, rows: torch.Tensor, j: int) -> torch.Tensor:
        c0, c1 = self.bounds[j]
        n = c1 - c0
        return (
            rows.view(self.ep, self.e_loc, n, self.h)
            .transpose(0, 1)
            .reshape(self.e_loc, self.ep * n, self.h)
        )

    def from_compute(self, out: torch.Tensor, j: int) -> torch.Tensor:
        c0, c1 = self.bounds[j]
        n = c1 - c0
        return out.view(self.e_loc, self.ep, n, self.h).transpose(0, 1).reshape(-1, self.h)

    def new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        # empty, not zeros: the chunks' ranges cover [0, C), so every row is written by a put
        return torch.empty(self.e, self.c, self.h, dtype=like.dtype, device=like.device)


class DroplessChunks:
    """Chunks of an expert-major [N, H] buffer: part j of every expert's segment. ``transport``
    is chosen once, here (one layer call)."""

    def __init__(
        self, counts: list[int], recv_counts: list[list[int]], hidden: int, ep: int, k: int, device
    ):
        self.h, self.ep, self.k, self.n = hidden, ep, k, sum(counts)
        self.transport = transport()
        e = len(counts)
        self.e_loc = e // ep
        starts = [sum(counts[:i]) for i in range(e)]
        parts = [_split(c, k) for c in counts]
        self.index, self.in_splits, self.out_splits, self.perm, self.seg = [], [], [], [], []
        for j in range(k):
            rows = []
            for i in range(e):
                a = starts[i] + sum(parts[i][:j])
                rows.extend(range(a, a + parts[i][j]))
            self.index.append(torch.tensor(rows, dtype=torch.int64, device=device))
            self.in_splits.append(
                [
                    sum(parts[i][j] for i in range(r * self.e_loc, (r + 1) * self.e_loc))
                    for r in range(ep)
                ]
            )
            # what each source sends us for chunk j, per local expert
            got = [
                [_split(recv_counts[s][le], k)[j] for le in range(self.e_loc)] for s in range(ep)
            ]
            self.out_splits.append([sum(g) for g in got])
            pos, acc = {}, 0
            for s in range(ep):
                for le in range(self.e_loc):
                    pos[s, le] = acc
                    acc += got[s][le]
            order = [
                i
                for le in range(self.e_loc)
                for s in range(ep)
                for i in range(pos[s, le], pos[s, le] + got[s][le])
            ]
            self.perm.append(torch.tensor(order, dtype=torch.int64, device=device))
            self.seg.append([sum(got[s][le] for s in range(ep)) for le in range(self.e_loc)])

    def take(self, buf: torch.Tensor, j: int) -> torch.Tensor:
        return buf.index_select(0, self.index[j])

    def put(self, buf: torch.Tensor, j: int, rows: torch.Tensor) -> None:
        buf.index_copy_(0, self.index[j], rows)

    def to_compute(self, rows: torch.Tensor, j: int) -> torch.Tensor:
        return rows.index_select(0, self.perm[j])

    def from_compute(self, out: torch.Tensor, j: int) -> torch.Tensor:
        return torch.empty_like(out).index_copy_(0, self.perm[j], out)

    def new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        # empty, not zeros: the chunks' index lists cover all n rows, each written by a put
        return torch.empty(self.n, self.h, dtype=like.dtype, device=like.device)


def _pipelined(buf: torch.Tensor, chunks, group, work) -> torch.Tensor:
    """Send ``buf``'s chunks to their experts, run ``work(rows, j)`` on what arrives for chunk j
    and send its result back, into a new buffer in ``buf``'s layout. While chunk j is worked on,
    chunk j+1 travels out and chunk j-1's result travels back."""
    k = len(chunks.in_splits)
    out = chunks.new_buffer(buf)

    def send(j: int) -> _Pending:
        return start_all_to_all(
            chunks.take(buf, j), group, chunks.out_splits[j], chunks.in_splits[j], chunks.transport
        )

    outgoing = send(0) if k else None
    returning = []
    for j in range(k):
        arriving, outgoing = outgoing, (send(j + 1) if j + 1 < k else None)
        result = work(chunks.to_compute(arriving.wait(), j), j)
        back = chunks.from_compute(result, j)
        returning.append(
            start_all_to_all(
                back, group, chunks.in_splits[j], chunks.out_splits[j], chunks.transport
            )
        )
    for j, pending in enumerate(returning):
        chunks.put(out, j, pending.wait())
    return out


class OverlappedExperts(torch.autograd.Function):
    """permuted -> expert outputs in the same layout, with the all-to-alls of chunk i±1 in flight
    while chunk i computes. ``compute(x, j)`` runs the local experts on chunk j (a differentiable
    function of x and the expert parameters ``params``)."""

    @staticmethod
    def forward(ctx, permuted, chunks, compute, group, *params):
        saved = []

        def forward_chunk(rows, j):
            x = rows.detach().requires_grad_(permuted.requires_grad)
            with torch.enable_grad():
                y = compute(x, j)
            saved.append((x, y))
            return y.detach()

        out = _pipelined(permuted, chunks, group, forward_chunk)
        ctx.chunks, ctx.group, ctx.saved, ctx.params = chunks, group, saved, params
        return out

    @staticmethod
    def backward(ctx, grad_out):
        chunks, group, saved, params = ctx.chunks, ctx.group, ctx.saved, ctx.params
        grad_params = [None] * len(params)

        def backward_chunk(g_y, j):
            x, y = saved[j]
            needs = [x] if x.requires_grad else []
            grads = torch.autograd.grad(y, [*needs, *params], g_y, allow_unused=True)
            for i, g in enumerate(grads[len(needs) :]):
                if g is not None:
                    grad_params[i] = g if grad_params[i] is None else grad_params[i] + g
            return grads[0] if needs else torch.zeros_like(x)

        grad_in = _pipelined(grad_out, chunks, group, backward_chunk)
        ctx.saved = None
        return (grad_in, None, None, None, *grad_params)
