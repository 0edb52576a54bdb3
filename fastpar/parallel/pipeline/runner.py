"""The step loop of ``PipelineEngine``: one schedule's actions ``(kind, micro-batch, chunk)`` for
this rank, forwards and backwards (B and W for zero bubble), over the engine's P2P channels, one
tag per (virtual stage, direction) (docs/pipelines.md, "Inside the engine"). Each kind is a
``Step`` in a table (``STEPS``, ``SPLIT_STEPS``): what it receives and what it runs, over the
state the steps share (``Steps``)."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from fastpar.parallel.pipeline.p2p import tuple_message
from fastpar.parallel.pipeline.zb import SplitBackward
from fastpar.profiling import nvtx

#: how many actions ahead of the current one their receives are posted (``P2P.post_recv``)
LOOKAHEAD = 2
_UNKNOWN = object()  # a backward's receive before its forward ran (its slots are not known)


def act_tag(vstage: int) -> int:
    """Channel of the activations into virtual stage ``vstage``."""
    return 2 * vstage


def grad_tag(vstage: int) -> int:
    """Channel of the output gradients into virtual stage ``vstage`` (from ``vstage + 1``)."""
    return 2 * vstage + 1


@dataclasses.dataclass
class Action:
    """The ``k``-th action of this rank, on virtual stage ``s`` (``first`` / ``last`` of the
    pipeline's virtual stages)."""

    k: int
    kind: str
    i: int  # micro-batch
    c: int  # model chunk
    s: int
    first: bool
    last: bool
    label: str


@dataclasses.dataclass
class Steps:
    """The state the steps of one ``_run_steps`` share: what they read (the engine, the
    micro-batches, the stored forwards) and what they account (stored bytes and their peak,
    busy seconds)."""

    engine: StepRunner
    actions: list
    xs: list | None
    ys: list | None
    device: torch.device
    saved: dict
    losses: list
    p2p: object
    train: bool
    table: dict
    live: int = 0
    peak: int = 0
    busy: float = 0.0
    p: int = dataclasses.field(init=False)  # pipeline ranks
    r: int = dataclasses.field(init=False)  # this rank
    nv: int = dataclasses.field(init=False)  # its model chunks
    last_vs: int = dataclasses.field(init=False)  # the last virtual stage
    last_backward: int = dataclasses.field(init=False)  # the action ending the backward, or -1

    def __post_init__(self) -> None:
        mesh = self.engine.mesh
        self.p, self.r, self.nv = mesh.pp_size, mesh.pp_rank, len(self.engine.chunks)
        self.last_vs = self.p * self.nv - 1
        ends = [k for k, a in enumerate(self.actions) if self.step(a[0]).ends_backward]
        self.last_backward = ends[-1] if ends else -1

    def step(self, kind: str) -> Step:
        if kind not in self.table:
            raise ValueError(f"pipeline step kind {kind!r}: this schedule runs {list(self.table)}")
        return self.table[kind]

    def action(self, k: int) -> Action:
        kind, i, c = self.actions[k]
        s = c * self.p + self.r
        label = f"mb{i}" + (f" chunk{c}" if self.nv > 1 else "")
        return Action(k, kind, i, c, s, s == 0, s == self.last_vs, label)

    def recv_need(self, k: int):
        """What action ``k`` receives before its compute: ``(peer, tag)``, None, or ``_UNKNOWN``."""
        a = self.action(k)
        return self.step(a.kind).recv(a, self)

    def sync(self, a: Action) -> tuple[bool, contextlib.AbstractContextManager]:
        """Whether action ``a`` ends this rank's backward (the gradients reduce), and the
        context it runs in: the engine's ``no_sync()`` where it does not."""
        no_sync = self.engine.no_sync
        sync = a.k == self.last_backward or no_sync is None
        return sync, contextlib.nullcontext() if sync else no_sync()


class Step:
    """One kind of action: ``recv``, what it receives before its compute (``(peer, tag)``,
    None, or ``_UNKNOWN``); ``run``, the compute and its sends. ``ends_backward``: the kind
    whose last action ends a micro-batch's backward (outside ``no_sync``)."""

    ends_backward = False

    def recv(self, a: Action, st: Steps):
        return None

    def run(self, a: Action, got, st: Steps) -> None:
        raise NotImplementedError


class Forward(Step):
    """F: the chunk's forward (the loss on the last virtual stage), its output sent on."""

    def recv(self, a: Action, st: Steps):
        return None if a.first else (st.p2p.prev, act_tag(a.s))

    def run(self, a: Action, got, st: Steps) -> None:
        engine, p2p = st.engine, st.p2p
        x = st.xs[a.i] if a.first else got
        t0 = time.perf_counter()
        target = st.ys[a.i] if a.last else None
        if not st.train:
            with nvtx(f"stage{st.r} eval forward {a.label}"), torch.no_grad():
                out = engine._run(a.c, x, target)
            entry, nbytes = {}, 0
        else:
            entry, nbytes = engine._forward(a.c, x, target, a.first, a.last, st.device, a.label)
            out = entry.pop("_out")
            st.saved[(a.i, a.c)] = entry
        st.live += nbytes
        st.peak = max(st.peak, st.live)
        st.busy += time.perf_counter() - t0
        if a.last:
            st.losses.append(out.detach())
        elif isinstance(out, torch.Tensor):
            p2p.send(out, p2p.next, tag=act_tag(a.s + 1))
        elif not st.train:
            p2p.send(tuple_message(out), p2p.next, tag=act_tag(a.s + 1))
        else:
            out = tuple_message(out)
            flags = engine._grad_flags[a.c] if engine.recompute else _requires_grad(out)
            entry["slots"] = [j for j, f in enumerate(flags) if f]
            p2p.send(out, p2p.next, requires_grad=flags, tag=act_tag(a.s + 1))


class Backward(Step):
    """B: the whole backward of a forward, its input gradient sent back."""

    ends_backward = True

    def recv(self, a: Action, st: Steps):
        if a.last:
            return None
        entry = st.saved.get((a.i, a.c))
        if entry is None:  # its forward has not run: which slots get a gradient is not known
            return _UNKNOWN
        slots = entry.get("slots")  # None: a single-tensor output; [] no slot requires grad
        return (st.p2p.next, grad_tag(a.s)) if slots is None or slots else None

    def run(self, a: Action, got, st: Steps) -> None:
        engine = st.engine
        entry = st.saved.pop((a.i, a.c))
        slots = entry.get("slots")  # None: a single-tensor output
        t0 = time.perf_counter()
        _, no_sync = st.sync(a)
        with nvtx(f"stage{st.r} backward {a.label}"), no_sync, engine._in_context():
            target = st.ys[a.i] if a.last else None
            engine._backward(a.c, entry, got, slots, target, st.device)
        st.busy += time.perf_counter() - t0
        st.live -= entry["bytes"]
        if not a.first:
            engine._send_input_grad(entry["x"], st.p2p, grad_tag(a.s - 1))


class InputGrad(Backward):
    """B of a split backward (zero bubble): the input gradient only, sent back at once; the
    weight half waits in the stored entry for W."""

    ends_backward = False

    def run(self, a: Action, got, st: Steps) -> None:
        engine = st.engine
        entry = st.saved[(a.i, a.c)]
        slots = entry.get("slots")
        t0 = time.perf_counter()
        with nvtx(f"stage{st.r} input grad {a.label}"), engine._in_context():
            target = st.ys[a.i] if a.last else None
            dx = engine._backward_input(a.c, entry, got, slots, target, st.device)
        st.busy += time.perf_counter() - t0
        if not a.first and dx is not None:
            st.p2p.send(dx, st.p2p.prev, tag=grad_tag(a.s - 1))


class WeightGrad(Step):
    """W of a split backward: the weight gradients B left, the entry's bytes freed."""

    ends_backward = True

    def run(self, a: Action, got, st: Steps) -> None:
        engine = st.engine
        entry = st.saved.pop((a.i, a.c))
        t0 = time.perf_counter()
        sync, no_sync = st.sync(a)
        # W as several engine calls only where no reducer waits for the end of one
        # backward: no gradient sync at all, or one deferring inside no_sync
        if engine.grad_sync is None and engine.no_sync is None:
            prompt = True
        else:
            defers = getattr(engine.grad_sync, "defers_reduction_in_no_sync", False)
            prompt = not sync and bool(defers)
        with nvtx(f"stage{st.r} weight grad {a.label}"), no_sync, engine._in_context():
            entry.pop("split").weights(prompt=prompt)
        st.busy += time.perf_counter() - t0
        st.live -= entry["bytes"]


#: the step of each action kind: a schedule whose backward is whole, and a split one
STEPS: dict[str, Step] = {"F": Forward(), "B": Backward()}
SPLIT_STEPS: dict[str, Step] = {"F": Forward(), "B": InputGrad(), "W": WeightGrad()}


class StepRunner:
    """Mixed into ``PipelineEngine``: ``_run_steps`` and what it needs (``self.chunks``,
    ``self.mesh``, ``self.p2p``, ``self.recompute``, ...)."""

    def _run_steps(self, actions, xs, ys, device, saved, losses, *, p2p=None, train=True):
        """The schedule's forwards and backwards; returns (busy seconds, peak stored bytes).
        ``train=False``: forwards only, under no_grad, nothing stored."""
        p2p = self.p2p if p2p is None else p2p
        table = SPLIT_STEPS if self.schedule.splits_backward else STEPS
        st = Steps(self, actions, xs, ys, device, saved, losses, p2p, train, table)
        ahead = 0  # the actions before this one have their receives posted early or need none
        for k in range(len(actions)):
            a = st.action(k)
            self._mb = a.i  # (``context``: the micro-batch of this action)
            need = st.recv_need(k)
            got = None if need is None else p2p.recv(need[0], device, tag=need[1])
            ahead = max(ahead, k + 1)
            while ahead < min(k + 1 + LOOKAHEAD, len(actions)):  # post the next receives
                nxt = st.recv_need(ahead)
                if nxt is _UNKNOWN or (nxt and not p2p.post_recv(nxt[0], device, tag=nxt[1])):
                    break  # receives are posted in order: none later before this one
                ahead += 1
            st.step(a.kind).run(a, got, st)
        if p2p.posted_recvs():  # every early receive belongs to an action of this step
            raise RuntimeError(f"{p2p.posted_recvs()} early pipeline receives left unmatched")
        return st.busy, st.peak

    def _forward(self, c, x, target, first, last, device, label) -> tuple[dict, int]:
        """A training forward of chunk ``c``: the entry its backward needs (its output under
        "_out") and the bytes it stores."""
        if not first and isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_(True)  # (tuple slots arrive flagged by their sender)
        entry, nbytes = {"x": x}, _nbytes(x)
        if self.recompute:  # the recomputed forward replays this RNG state
            entry["rng"] = _get_rng(device)
        with nvtx(f"stage{self.mesh.pp_rank} forward {label}"):
            if self.recompute:
                with torch.no_grad():
                    out = self._run(c, x, target)
                if not last and not isinstance(out, torch.Tensor) and c not in self._grad_flags:
                    self._grad_flags[c] = self._learn_grad_flags(c, x, device)
            elif self.measure_activations:
                out, graph_bytes = self._run_counting(c, x, target)
                entry["out"] = out
                nbytes += graph_bytes
            else:
                entry["out"] = out = self._run(c, x, target)
        entry["bytes"], entry["_out"] = nbytes, out
        return entry, nbytes

    def _recomputed(self, c: int, entry: dict, target, device):
        """The chunk's forward again, with grad, under the RNG state of the first one."""
        rng = _get_rng(device)
        _set_rng(entry["rng"])
        with torch.enable_grad():
            out = self._run(c, entry["x"], target)
        _set_rng(rng)
        return out

    def _backward(self, c: int, entry: dict, grad, slots, target, device) -> None:
        out = self._recomputed(c, entry, target, device) if self.recompute else entry["out"]
        if target is not None:
            loss = self.scale_loss(out) if self.scale_loss is not None else out
            loss.backward()
        elif slots is None:
            torch.autograd.backward(out, grad)
        elif slots:
            torch.autograd.backward(_grad_outputs(out, slots), list(grad))

    def _backward_input(self, c: int, entry: dict, grad, slots, target, device):
        """B of a split backward: the input gradient to send back (a tensor, a tuple of the
        slots that require grad, or None); the W half is kept in ``entry["split"]``. Under
        recompute the forward runs again first, and its graph lives until W."""
        last = target is not None
        out = self._recomputed(c, entry, target, device) if self.recompute else entry.pop("out")
        if last:
            roots = [self.scale_loss(out) if self.scale_loss is not None else out]
            grads = [None]
        elif slots is None:
            roots, grads = [out], [grad]
        elif slots:
            roots, grads = _grad_outputs(out, slots), list(grad)
        else:  # no output slot requires grad: nothing flows back
            roots, grads = [], []
        x = entry["x"]
        single = isinstance(x, torch.Tensor)
        wanted = [x] if single else [t for t in x if t is not None]
        wanted = [t for t in wanted if t.requires_grad]
        entry["split"] = split = SplitBackward(roots, grads, wanted)
        got = split.input_grads()
        got = [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, got, strict=True)]
        if not wanted:
            return None
        return got[0] if single else tuple(got)

    def _in_context(self):
        """The engine's ``context`` of the running action's micro-batch (its packed documents,
        its MTP tokens): around its forward, and around its backward too, where a checkpointed
        block (--recompute) runs its forward again and must see the same documents."""
        return self._context(self._mb) if self._context is not None else contextlib.nullcontext()

    def _run(self, c: int, x, target):
        with self._in_context():
            out = self.chunks[c](x)
        if target is None:
            return out
        loss = self.loss_fn(out, target)
        if self._token_weight is not None:  # "token": the sum over the global count (engine)
            return loss * self._token_weight.to(loss.dtype)
        return loss / self.schedule.num_microbatches

    def _send_input_grad(self, x, p2p, tag: int) -> None:
        """The gradient of this chunk's input, to the previous virtual stage: of the tensor if it
        requires grad, or of each tuple slot that does (zeros for one the chunk did not use)."""
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                p2p.send(x.grad, p2p.prev, tag=tag)
        elif wanted := [t for t in x if t is not None and t.requires_grad]:
            grads = tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in wanted)
            p2p.send(grads, p2p.prev, tag=tag)

    def _learn_grad_flags(self, c: int, x, device: torch.device) -> list[bool]:
        """Which slots of chunk ``c``'s tuple output require grad: its forward of ``x`` once
        more with grad enabled, the output and graph dropped, the RNG left as it was."""
        rng = _get_rng(device)
        with torch.enable_grad():
            flags = _requires_grad(tuple_message(self._run(c, x, None)))
        _set_rng(rng)
        return flags

    def _run_counting(self, c: int, x, target) -> tuple[torch.Tensor, int]:
        """Forward keeping the graph; also the bytes autograd saved for backward."""
        counted = [0]

        def pack(t):
            counted[0] += _nbytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self._run(c, x, target)
        return out, counted[0]


def _get_rng(device: torch.device) -> tuple:
    """The RNG state a forward draws from: the CPU generator's, and the device's on a GPU."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), device, cuda


def _set_rng(state: tuple) -> None:
    cpu, device, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _nbytes(t) -> int:
    if isinstance(t, tuple | list):
        return sum(_nbytes(u) for u in t if u is not None)
    return t.numel() * t.element_size()


def _requires_grad(msg: tuple) -> list[bool]:
    return [t is not None and t.requires_grad for t in msg]


def _grad_outputs(out: tuple, slots: list[int]) -> list[torch.Tensor]:
    """The output slots that receive a gradient; each must require grad (a recomputed forward
    must produce what the first one announced)."""
    lost = [j for j in slots if not (isinstance(out[j], torch.Tensor) and out[j].requires_grad)]
    if lost:
        raise RuntimeError(
            f"stage output slots {lost} required grad when first sent but not in this backward "
            "(the stage's output changed between its forward and its recomputation); a stage "
            "must return the same kinds of tensors for every micro-batch"
        )
    return [out[j] for j in slots]
