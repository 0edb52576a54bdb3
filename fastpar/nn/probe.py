"""Which replicated parameters see tensor-parallel-split activations: a data-flow probe that runs
the DENSE model once on a tiny input, on one process, labelling every tensor split, full or
parameter-derived, and records each watched parameter's uses and the contractions that make a
plan wrong (docs/hf.md, "parallelize")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

SPLIT, FULL = "split", "full"

_CONTRACTIONS = {
    "linear",
    "matmul",
    "mm",
    "bmm",
    "baddbmm",
    "addmm",
    "addbmm",
    "addmv",
    "mv",
    "einsum",
    "tensordot",
    "scaled_dot_product_attention",
    "conv1d",
    "conv2d",
    "embedding",
    "bilinear",
    "__matmul__",
    "__rmatmul__",
}


@dataclass
class ProbeReport:
    """What the probe saw. ``uses[name]``: the kinds of value ({"split", "full"}) parameter
    ``name`` met; ``contracted``: parameters contracted with a split value (name -> where);
    ``mixed``: (where, split source) of contractions of a split value with a full activation;
    ``features``: parameters applied elementwise along the split features themselves (a bias or
    scale of a column output's width: it would have to be split too), name -> (where, source)."""

    uses: dict[str, set[str]] = field(default_factory=dict)
    contracted: dict[str, str] = field(default_factory=dict)
    features: dict[str, tuple[str, str]] = field(default_factory=dict)
    mixed: list[tuple[str, str]] = field(default_factory=list)
    output_split: bool = False
    shared: dict[str, tuple[int, int, int, str]] = field(default_factory=dict)
    """Unplanned linear layers whose output features [lo, hi) of ``width`` enter an op with a
    split value outside a contraction (a key broadcast into every local head): module name ->
    (lo, hi, width, where). Their gradient there is this rank's heads' share only."""


def _op_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _tensors(obj, out: list | None = None) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested tuples, lists and dicts, a ModelOutput's values), in
    order: what ``tree_flatten`` finds there, without its per-node cost on every op."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


class _Labeller(TorchFunctionMode):
    def __init__(self, watched: Mapping[int, str], report: ProbeReport):
        super().__init__()
        self.watched, self.report = watched, report
        # id -> (SPLIT, source, width of the last dim if it is still the split dim, else None)
        #       | (FULL,) | ("param", names)
        self.labels: dict[int, tuple] = {}
        self.keep: list[torch.Tensor] = []  # ids stay valid while the probe runs
        self.suspended = 0
        self.where: list[str] = []

    def label(self, t: torch.Tensor, value: tuple) -> None:
        self.labels[id(t)] = value
        self.keep.append(t)

    def _of(self, t: torch.Tensor) -> tuple | None:
        name = self.watched.get(id(t))
        if name is not None:
            return ("param", frozenset([name]))
        return self.labels.get(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suspended:
            return out
        tensors = _tensors((args, kwargs))
        split_src, full, params, widths, param_widths = None, False, set(), set(), {}
        for t in tensors:
            lab = self._of(t)
            if lab is None:
                continue
            if lab[0] == SPLIT:
                split_src = split_src or lab[1]
                widths.add(lab[2])
            elif lab[0] == FULL:
                full = True
            else:
                params |= lab[1]
                for name in lab[1]:
                    param_widths.setdefault(name, set()).add(t.shape[-1] if t.dim() else None)
        op = _op_name(func)
        where = self.where[-1] if self.where else "<model>"
        origins = {lab[1] for t in tensors if (lab := self._of(t)) and lab[0] == FULL and lab[1:]}
        origins.discard(None)
        if split_src is not None and op not in _CONTRACTIONS:
            for module, lo, hi, width in origins:
                self.report.shared.setdefault(module, (lo, hi, width, f"{op} in {where!r}"))
        origin = _origin(op, args, out, params, full, split_src, origins, self)
        if split_src is not None or full:
            for name in params:
                self.report.uses.setdefault(name, set()).add(SPLIT if split_src else FULL)
                if split_src and op in _CONTRACTIONS:
                    self.report.contracted.setdefault(name, f"{op} in {where!r}")
                elif split_src and widths & param_widths[name] - {None, 1}:
                    self.report.features.setdefault(name, (f"{op} in {where!r}", split_src))
        if split_src is not None and full and op in _CONTRACTIONS:
            self.report.mixed.append((f"{op} in {where!r}", split_src))
        if split_src is None and not full and not params:
            return out
        outs = _tensors(out)
        in_place = op.endswith("_") or op in ("__setitem__", "__iadd__", "__imul__")
        if in_place and args and isinstance(args[0], torch.Tensor):
            outs.append(args[0])  # in place: the destination takes the label
        for t in outs:
            if split_src is not None:
                # the last dim is still the split one only through elementwise ops keeping it
                (w,) = widths if len(widths) == 1 else (None,)
                keeps = w is not None and op not in _CONTRACTIONS and t.dim() and t.shape[-1] == w
                self.label(t, (SPLIT, split_src, w if keeps else None))
            elif full:
                self.label(t, (FULL, origin(t)))
            else:
                self.label(t, ("param", frozenset(params)))
        return out


_SLICES = {"split", "split_with_sizes", "narrow", "chunk", "tensor_split", "__getitem__"}


def _origin(op, args, out, params, full, split_src, origins, mode) -> Callable:
    """The origin each full output carries: (linear module, lo, hi, width) for the output of a
    linear layer no plan swaps (features [0, width)) and for a view of features [lo, hi) sliced
    off it; any other op passes on its inputs' one origin (none when they differ)."""
    names = {n.rpartition(".")[0] for n in params}
    if op == "linear" and full and split_src is None and len(names) == 1:
        (module,) = names
        return lambda t: (module, 0, t.shape[-1], t.shape[-1]) if t.dim() else None
    base = args[0] if args and isinstance(args[0], torch.Tensor) else None
    whole = mode._of(base) if base is not None else None
    if op in _SLICES and whole is not None and whole[0] == FULL and whole[1:] and whole[1]:
        module, lo, hi, width = whole[1]
        if (lo, hi) == (0, width) and base.dim():

            def sliced(t: torch.Tensor):
                view = t.dim() == base.dim() and t.shape[:-1] == base.shape[:-1]
                if not view or t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                    return whole[1]
                off = t.storage_offset() - base.storage_offset()
                if 0 <= off <= width - t.shape[-1] and t.stride() == base.stride():
                    return (module, off, off + t.shape[-1], width)
                return whole[1]

            return sliced
    one = next(iter(origins)) if len(origins) == 1 else None
    return lambda t: one


class ProbeFailed(RuntimeError):
    """The model's own forward raised on the probe input (the cause is chained)."""


def probe(
    model: nn.Module,
    inputs: tuple,
    kwargs: Mapping,
    styles: Mapping[str, str],
    watched: Mapping[int, str],
    grad: bool = False,
):
    """Run ``model(*inputs, **kwargs)`` once under the labeller (with autograd when ``grad``:
    the check's float64 run is the probe's, ``check.dense_runs``); returns (``ProbeReport``, the
    model's output).
    ``styles`` maps planned module names to "split" (their output is split) or "full";
    ``watched`` maps id(parameter) to its name for the parameters no planned module owns.
    Raises ``ProbeFailed`` when the model's forward raises."""
    report = ProbeReport()
    mode = _Labeller(watched, report)
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    handles = []

    def enter(module, _args):
        mode.where.append(names.get(id(module), type(module).__name__))
        if names.get(id(module)) in styles:
            mode.suspended += 1

    def leave_planned(name: str) -> Callable:
        def hook(module, _args, output):
            mode.suspended -= 1
            mode.where.pop()
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor):  # split along the last dim (features)
                    split = styles[name] == SPLIT
                    mode.label(
                        t, (SPLIT, name, t.shape[-1] if t.dim() else None) if split else (FULL,)
                    )

        return hook

    def leave(module, _args, _output):
        mode.where.pop()

    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(enter))
        if name in styles:
            handles.append(module.register_forward_hook(leave_planned(name), always_call=True))
        else:
            handles.append(module.register_forward_hook(leave, always_call=True))
    was_training = model.training
    model.eval()
    try:
        with torch.set_grad_enabled(grad), mode:
            for t in tree_flatten((inputs, dict(kwargs)))[0]:
                if isinstance(t, torch.Tensor):
                    mode.label(t, (FULL,))
            try:
                out = model(*inputs, **kwargs)
            except Exception as exc:
                raise ProbeFailed(f"{type(exc).__name__}: {exc}") from exc
            first = next(
                (t for t in tree_flatten(_plain(out))[0] if isinstance(t, torch.Tensor)), None
            )
            report.output_split = (
                first is not None and mode._of(first) is not None and (mode._of(first)[0] == SPLIT)
            )
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return report, out


def _plain(out):
    """A Hugging Face ModelOutput as a tuple of its fields (logits first), else ``out``."""
    to_tuple = getattr(out, "to_tuple", None)
    return to_tuple() if callable(to_tuple) else out
