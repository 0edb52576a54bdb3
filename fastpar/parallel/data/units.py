"""ZeRO-3's units: which parameters are gathered together (the wrap policy), and when their full
values live (gather, free, regather in backward, prefetch): docs/layouts.md ("The data-parallel
family")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from fastpar.parallel.data.flat import FREE, GATHERED, GATHERING, RESHARDED, FlatShard


@dataclass(eq=False)
class Unit:
    module: nn.Module
    name: str
    flats: list[FlatShard] = field(default_factory=list)


def select_units(
    module: nn.Module, wrap: Sequence[type] | None, min_params: int | None
) -> list[tuple[str, nn.Module]]:
    """Wrapped submodules (not the root), in registration order."""
    if wrap is not None and min_params is not None:
        raise ValueError("pass either wrap= (module types) or min_params=, not both")
    if wrap is not None:
        types = tuple(wrap)
        return [(n, m) for n, m in module.named_modules() if n and isinstance(m, types)]
    if min_params is None:
        return []
    if min_params < 1:
        raise ValueError(f"min_params must be >= 1, got {min_params}")
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, m: nn.Module) -> int:  # post order: unwrapped elements in the subtree
        count = sum(p.numel() for p in m.parameters(recurse=False))
        for cname, child in m.named_children():
            count += visit(f"{name}.{cname}" if name else cname, child)
        if name and count >= min_params:
            chosen.append((name, m))
            return 0
        return count

    visit("", module)
    order = {id(m): i for i, (_, m) in enumerate(module.named_modules())}
    return sorted(chosen, key=lambda nm: order[id(nm[1])])


class Units:
    """The units of ``module`` under ``root`` (the wrapper) and the gather / free schedule of
    their sharded flats. ``prefetch``: overlap the next unit's gather with this one's compute."""

    def __init__(
        self,
        root: nn.Module,
        module: nn.Module,
        wrap: Sequence[type] | None,
        min_params: int | None,
        prefetch: bool,
    ) -> None:
        subunits = select_units(module, wrap, min_params)
        self.units = [Unit(root, "<root>")] + [Unit(m, n) for n, m in subunits]
        self.prefetch = prefetch
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self._module = module
        self._flats: list[FlatShard] = []
        self._order_prev: list[int] = list(range(len(self.units)))
        self._order: list[int] = []
        self._backward_started = False
        self._handles: list = []

    def owners(self) -> dict[int, int]:
        """id(trainable parameter) -> its unit (shared between units: the root)."""
        unit_of_module = {id(u.module): i for i, u in enumerate(self.units) if i}
        owner: dict[int, int] = {}

        def assign(m: nn.Module, unit: int) -> None:
            unit = unit_of_module.get(id(m), unit)
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    owner[id(p)] = unit if owner.get(id(p), unit) == unit else 0
            for child in m.children():
                assign(child, unit)

        assign(self._module, 0)
        return owner

    def attach(self, flats: list[FlatShard]) -> None:
        """Take the flats (full buffers gathered, parameters still their own tensors), free
        the sharded ones and hook the units' forwards."""
        self._flats = flats
        for f in flats:
            self.units[f.unit].flats.append(f)
            if f.sharded:
                f.state = GATHERED
                self.gathered_bytes += f.full_bytes
                self.free(f)
        for ui, u in enumerate(self.units[1:], start=1):
            self._handles.append(u.module.register_forward_pre_hook(self._pre_hook(ui)))
            self._handles.append(u.module.register_forward_hook(self._post_hook(ui)))

    # -- gather / free ------------------------------------------------------------------------
    def gather_async(self, f: FlatShard, key: str) -> None:
        if not f.sharded or f.state in (GATHERING, GATHERED):
            return
        f.full.untyped_storage().resize_(f.full_bytes)
        self.gathered_bytes += f.full_bytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        with torch.no_grad():
            f.full[f.mine].copy_(f.shard)
        f.work = f.gather(key)
        f.state = GATHERING

    def wait(self, f: FlatShard) -> None:
        if f.state != GATHERING:
            return
        if f.work is not None:
            f.work.wait()
            f.work = None
        with torch.no_grad():
            for i, p in enumerate(f.params):
                if p.data.data_ptr() != f.full.data_ptr() + f.bucket.offsets[i] * p.element_size():
                    p.data = f.view(f.full, i)
        f.state = GATHERED

    def gather_unit(self, ui: int, key: str) -> None:
        for f in self.units[ui].flats:
            self.gather_async(f, key)
        for f in self.units[ui].flats:
            self.wait(f)

    def release(self, f: FlatShard, keep_views: bool) -> None:
        if not f.sharded or f.state == FREE:
            return
        if f.state == GATHERING:
            self.wait(f)
        if f.state == GATHERED:
            f.full.untyped_storage().resize_(0)
            self.gathered_bytes -= f.full_bytes
        if keep_views:
            f.state = RESHARDED
            return
        with torch.no_grad():
            for p, e in zip(f.params, f.empties, strict=True):
                p.data = e
        f.state = FREE

    def free(self, f: FlatShard) -> None:
        self.release(f, keep_views=False)

    def _prefetch(self, candidates: Sequence[int], states: tuple[str, ...], key: str) -> None:
        """Start the gather of the first unit in ``candidates`` with a flat in ``states``."""
        if not self.prefetch:
            return
        for ui in candidates:
            flats = [f for f in self.units[ui].flats if f.sharded]
            if any(f.state in states for f in flats):
                for f in flats:
                    if f.state in states:
                        self.gather_async(f, key)
                return

    # -- forward / backward -------------------------------------------------------------------
    def before_forward(self, ui: int) -> None:
        if ui not in self._order:
            self._order.append(ui)
        self.gather_unit(ui, "all_gather_forward")
        order = self._order_prev
        if ui in order:
            nxt = order[order.index(ui) + 1 :]
            self._prefetch(nxt[:1], (FREE, RESHARDED), "all_gather_forward")

    def after_forward(self, ui: int, output) -> None:
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        backward = torch.is_grad_enabled() and bool(tensors)
        for f in self.units[ui].flats:
            self.release(f, keep_views=backward)
        if backward:
            register_multi_grad_hook(
                tensors, lambda _g, ui=ui: self._before_backward(ui), mode="any"
            )
        elif ui == 0:  # no backward will follow (inference): drop prefetched units too
            for f in self._flats:
                self.free(f)
            self._order_prev, self._order = self._order or self._order_prev, []

    def _before_backward(self, ui: int) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.gather_unit(ui, "all_gather_backward")
        later = [u for u in reversed(self._order) if u != ui]
        self._prefetch(later, (RESHARDED,), "all_gather_backward")

    def _end_of_backward(self) -> None:
        self._backward_started = False
        for f in self._flats:
            self.free(f)
        if self._order:
            self._order_prev, self._order = self._order, []

    def _pre_hook(self, ui: int):
        def hook(_module, _args):
            self.before_forward(ui)

        return hook

    def _post_hook(self, ui: int):
        def hook(_module, _args, output):
            self.after_forward(ui, output)

        return hook

    @contextlib.contextmanager
    def summon(self) -> Iterator[None]:
        """Every unit's full parameters, gathered (collective: call on every rank), freed on
        exit; writes are not kept."""
        for u in self.units:
            for f in u.flats:
                self.gather_async(f, "summon")
        for f in self._flats:
            self.wait(f)
        try:
            yield
        finally:
            for f in self._flats:
                self.free(f)
