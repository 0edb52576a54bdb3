"""The step loop of ``PipelineEngine``: one schedule's actions ``(kind, micro-batch, chunk)`` for
this rank, forwards and backwards (B and W for zero bubble), over the engine's P2P channels, one
tag per (virtual stage, direction) (docs/pipelines.md, "Inside the engine")."""

from __future__ import annotations

import contextlib
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


class StepRunner:
    """Mixed into ``PipelineEngine``: ``_run_steps`` and what it needs (``self.chunks``,
    ``self.mesh``, ``self.p2p``, ``self.recompute``, ...)."""

    def _run_steps(self, actions, xs, ys, device, saved, losses, *, p2p=None, train=True):
        """The schedule's forwards and backwards; returns (busy seconds, peak stored bytes).
        ``train=False``: forwards only, under no_grad, nothing stored."""
        p2p = self.p2p if p2p is None else p2p
        mesh, nv = self.mesh, len(self.chunks)
        p, r = mesh.pp_size, mesh.pp_rank
        last_vs = p * nv - 1
        split = self.schedule.splits_backward  # "B": input grad only; "W": weight grads
        backwards = [k for k, a in enumerate(actions) if a[0] == ("W" if split else "B")]
        last_backward = backwards[-1] if backwards else -1
        live = peak = 0
        busy = 0.0
        ahead = 0  # the actions before this one have their receives posted early or need none

        for k, (kind, i, c) in enumerate(actions):
            self._mb = i  # (``context``: the micro-batch of this action)
            s = c * p + r
            first, last = s == 0, s == last_vs
            label = f"mb{i}" + (f" chunk{c}" if nv > 1 else "")
            need = _recv_need(actions[k], saved, p, r, last_vs, p2p)
            got = None if need is None else p2p.recv(need[0], device, tag=need[1])
            ahead = max(ahead, k + 1)
            while ahead < min(k + 1 + LOOKAHEAD, len(actions)):  # post the next receives
                nxt = _recv_need(actions[ahead], saved, p, r, last_vs, p2p)
                if nxt is _UNKNOWN or (nxt and not p2p.post_recv(nxt[0], device, tag=nxt[1])):
                    break  # receives are posted in order: none later before this one
                ahead += 1
            if kind == "F":
                x = xs[i] if first else got
                t0 = time.perf_counter()
                target = ys[i] if last else None
                if not train:
                    with nvtx(f"stage{r} eval forward {label}"), torch.no_grad():
                        out = self._run(c, x, target)
                    entry, nbytes = {}, 0
                else:
                    entry, nbytes = self._forward(c, x, target, first, last, device, label)
                    out = entry.pop("_out")
                    saved[(i, c)] = entry
                live += nbytes
                peak = max(peak, live)
                busy += time.perf_counter() - t0
                if last:
                    losses.append(out.detach())
                elif isinstance(out, torch.Tensor):
                    p2p.send(out, p2p.next, tag=act_tag(s + 1))
                else:
                    out = tuple_message(out)
                    if not train:
                        p2p.send(out, p2p.next, tag=act_tag(s + 1))
                        continue
                    flags = self._grad_flags[c] if self.recompute else _requires_grad(out)
                    entry["slots"] = [j for j, f in enumerate(flags) if f]
                    p2p.send(out, p2p.next, requires_grad=flags, tag=act_tag(s + 1))
            elif kind == "W":
                entry = saved.pop((i, c))
                t0 = time.perf_counter()
                sync = k == last_backward or self.no_sync is None
                no_sync = contextlib.nullcontext() if sync else self.no_sync()
                # W as several engine calls only where no reducer waits for the end of one
                # backward: no gradient sync at all, or one deferring inside no_sync
                if self.grad_sync is None and self.no_sync is None:
                    prompt = True
                else:
                    defers = getattr(self.grad_sync, "defers_reduction_in_no_sync", False)
                    prompt = not sync and bool(defers)
                with nvtx(f"stage{r} weight grad {label}"), no_sync, self._in_context():
                    entry.pop("split").weights(prompt=prompt)
                busy += time.perf_counter() - t0
                live -= entry["bytes"]
            elif split:
                entry = saved[(i, c)]
                slots = entry.get("slots")
                t0 = time.perf_counter()
                with nvtx(f"stage{r} input grad {label}"), self._in_context():
                    dx = self._backward_input(c, entry, got, slots, ys[i] if last else None, device)
                busy += time.perf_counter() - t0
                if not first and dx is not None:
                    p2p.send(dx, p2p.prev, tag=grad_tag(s - 1))
            else:
                entry = saved.pop((i, c))
                slots = entry.get("slots")  # None: a single-tensor output
                t0 = time.perf_counter()
                sync = k == last_backward or self.no_sync is None
                no_sync = contextlib.nullcontext() if sync else self.no_sync()
                with nvtx(f"stage{r} backward {label}"), no_sync, self._in_context():
                    self._backward(c, entry, got, slots, ys[i] if last else None, device)
                busy += time.perf_counter() - t0
                live -= entry["bytes"]
                if not first:
                    self._send_input_grad(entry["x"], p2p, grad_tag(s - 1))
        if p2p.posted_recvs():  # every early receive belongs to an action of this step
            raise RuntimeError(f"{p2p.posted_recvs()} early pipeline receives left unmatched")
        return busy, peak

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
        """The gradient of this chunk's input, to the previous virtual stage: of the tensor if
        it requires grad, or of each tuple slot that does (zeros for one the chunk did not
        use)."""
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


def _recv_need(action, saved: dict, p: int, r: int, last_vs: int, p2p):
    """What ``action`` receives before its compute: ``(peer, tag)``, None, or ``_UNKNOWN``
    (a backward whose forward has not run: which slots get a gradient is not known yet)."""
    kind, i, c = action
    s = c * p + r
    if kind == "F":
        return None if s == 0 else (p2p.prev, act_tag(s))
    if kind == "W" or s == last_vs:
        return None
    entry = saved.get((i, c))
    if entry is None:
        return _UNKNOWN
    slots = entry.get("slots")  # None: a single-tensor output; [] no slot requires grad
    return (p2p.next, grad_tag(s)) if slots is None or slots else None


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
