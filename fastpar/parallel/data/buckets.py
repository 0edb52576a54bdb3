"""Gradient buckets: parameters grouped into contiguous flat buffers, reduced as backward fills
them, launched strictly in order and waited for at backward's end (docs/layouts.md, "The
data-parallel family")."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Bucket:
    """Parameters ``params`` (local shapes ``shapes``) at ``offsets`` of a flat buffer of
    ``padded_numel`` elements; ``group_index``: which input list they came from. The rest is the
    reducer's state for the backward in progress."""

    index: int
    dtype: torch.dtype
    group_index: int
    params: list[torch.nn.Parameter] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    padded_numel: int = 0
    ready: set = field(default_factory=set)
    launched: bool = False
    finished: bool = False
    work: object = None
    comm: object = None  # what the in-flight collective reads / writes, kept alive until finish

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of a [padded_numel] buffer, in the parameter's (local) shape."""
        off, shape = self.offsets[i], self.shapes[i]
        return buffer[off : off + shape.numel()].view(shape)

    def add(self, p: torch.nn.Parameter) -> None:
        self.params.append(p)
        self.shapes.append(p.shape)
        self.offsets.append(self.numel)
        self.numel += p.numel()


def build_buckets(
    param_groups: list[list[torch.nn.Parameter]],
    bucket_size_mb: float | None,
    pad_to: int | Sequence[int],
    *,
    reverse: bool = True,
) -> list[Bucket]:
    """Pack trainable parameters (per list and dtype; reverse order unless ``reverse=False``)
    into buckets of at most ``bucket_size_mb`` (None: no cap) whose size is a multiple of
    ``pad_to`` (one value, or one per list)."""
    pads = [pad_to] * len(param_groups) if isinstance(pad_to, int) else list(pad_to)
    if bucket_size_mb is not None and not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    cap = None if bucket_size_mb is None else int(bucket_size_mb * 2**20)
    buckets: list[Bucket] = []
    open_: dict[tuple, Bucket] = {}
    seen: set[int] = set()
    flat = [(gi, p) for gi, group in enumerate(param_groups) for p in group]
    for gi, p in reversed(flat) if reverse else flat:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        key = (gi, p.dtype)
        b = open_.get(key)
        full = cap is not None and (b.numel + p.numel()) * p.element_size() > cap if b else False
        if b is None or (b.numel > 0 and full):
            b = Bucket(index=len(buckets), dtype=p.dtype, group_index=gi)
            buckets.append(b)
            open_[key] = b
        b.add(p)
    for b in buckets:
        pad = pads[b.group_index]
        b.padded_numel = math.ceil(b.numel / pad) * pad if b.numel else pad
    return buckets


class BucketReducer:
    """Drives the per-parameter hooks and the in-order, asynchronous launch of each bucket.

    ``launch(bucket)`` starts the bucket's collective and returns its work handle (or None);
    ``finish(bucket)`` runs once the handle has completed. ``grad_target(bucket, i, param)``
    puts parameter i's fresh gradient where the bucket will reduce it (``param`` None: the
    parameter got no gradient in this backward and ``find_unused_parameters`` is on). ``bound``:
    finish bucket i - bound before launching bucket i.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        *,
        launch: Callable[[Bucket], object],
        finish: Callable[[Bucket], None],
        grad_target: Callable[[Bucket, int, torch.nn.Parameter | None], None],
        find_unused_parameters: bool = False,
        names: dict[int, str] | None = None,
        bound: int | None = None,
    ) -> None:
        self.buckets = buckets
        self._launch, self._finish, self._grad_target = launch, finish, grad_target
        self.find_unused_parameters = find_unused_parameters
        self.names = names or {}
        self.bound = bound
        self.sync_enabled = True
        self._callback_queued = False
        self._next = 0
        self._where = {}
        for b in buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook) for b in buckets for p in b.params
        ]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces them."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def _hook(self, p: torch.nn.Parameter) -> None:
        b, i = self._where[id(p)]
        self._grad_target(b, i, p)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b.ready.add(i)
        if self.sync_enabled:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                return
            if self.bound is not None and b.index >= self.bound:
                self.finish(self.buckets[b.index - self.bound])
            b.finished = False
            b.work = self._launch(b)
            b.launched = True
            self._next += 1

    def finish(self, b: Bucket) -> None:
        """Wait for bucket ``b``'s collective and run its finish step, once."""
        if not b.launched or b.finished:
            return
        if b.work is not None:
            b.work.wait()
            b.work = None
        b.finished = True
        self._finish(b)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if not self.sync_enabled:
            for b in self.buckets:
                b.ready.clear()
            return
        missing = [(b, i) for b in self.buckets for i in range(len(b.params)) if i not in b.ready]
        if missing and not self.find_unused_parameters:
            names = [
                self.names.get(id(b.params[i]), f"param {i} of bucket {b.index}")
                for b, i in missing
            ]
            for b in self.buckets:
                b.ready.clear()
            self._next = 0
            raise RuntimeError(
                f"{len(missing)} parameter(s) received no gradient in this backward: "
                f"{names[:8]}{' ...' if len(names) > 8 else ''}. Every rank must reduce the same "
                "buckets; pass find_unused_parameters=True (their gradient counts as zero) or "
                "remove the unused parameters from the model"
            )
        for b, i in missing:
            self._grad_target(b, i, None)
            b.ready.add(i)
        self._launch_ready()
        self.wait_all()

    def wait_all(self) -> None:
        """Wait for every launched bucket, run its finish step, reset for the next backward."""
        for b in self.buckets:
            self.finish(b)
            b.work, b.launched = None, False
            b.ready.clear()
        self._next = 0


def payload_bytes(kind: str, numel: int, element_size: int, world: int) -> float:
    """Bytes one rank sends for a collective over ``world`` ranks with ring algorithms:
    all-reduce 2(N-1)/N·B, reduce-scatter and all-gather (N-1)/N·B, B the full buffer."""
    full = numel * element_size
    factor = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}[kind]
    return factor * (world - 1) / world * full if world > 1 else 0.0
