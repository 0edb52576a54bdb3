"""``parallelize``'s own check: the dense model (fp32, its one-rounding twin and a float64 copy)
and the parallel one on the probe input, forward and backward, judged by ``fastpar.tolerance``'s
rule: the output, and every parameter's gradient against its slice of the dense gradient
(replicated ones also equal across the TP ranks). Equal-at-init parameters (norms at 1, biases
at 0) are perturbed first, on every rank alike, and restored exactly afterwards, so a per-head
mix-up cannot hide behind equal values (docs/hf.md, "The check")."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from fastpar import tolerance
from fastpar.comm import plain
from fastpar.mesh.placement import expert_layout, param_layout
from fastpar.mesh.ranks import group_rank, group_size

MODES = (True, False, "backward", "forward")
_LOSS_SEED, _PERTURB_SEED = 1234, 4321


def check_mode(check) -> str | None:
    """``check`` of ``parallelize`` as "backward", "forward" or None (off); ValueError else."""
    if check not in MODES:
        raise ValueError(f"check must be one of {MODES} (True = 'backward'), got {check!r}")
    return None if check is False else ("backward" if check is True else check)


def first_tensor(out) -> torch.Tensor | None:
    to_tuple = getattr(out, "to_tuple", None)
    flat = tree_flatten(to_tuple() if callable(to_tuple) else out)[0]
    return next((t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


@torch.no_grad()
def perturb(params: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Move each of ``params`` (the parameters no planned layer owns: norms, per-head scales,
    biases) by a deterministic random amount (the same on every rank: seeded by position), in
    place; returns their exact original values for ``restore``."""
    saved = {}
    g = torch.Generator().manual_seed(_PERTURB_SEED)
    for name, p in params.items():
        if not p.is_floating_point() or p.numel() == 0:
            continue
        saved[name] = p.detach().clone()
        rms = float(p.detach().double().square().mean().sqrt())
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1 * max(rms, 0.1)
        p.add_(noise.to(device=p.device, dtype=p.dtype))
    return saved


@torch.no_grad()
def restore(params: Mapping[str, nn.Parameter], saved: Mapping[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        params[name].copy_(value)


@dataclass
class Dense:
    """The dense runs on the probe input: output and gradients (by name) of the fp32 model,
    its twin and its float64 copy; ``length``: the longest reduction (the rule's n). The twin
    runs only when asked (``add_twin``): a quantity within the rule's bound on the fp32 run's
    error alone is within it on the larger of the two runs' errors too."""

    out: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    length: int = 1
    backward: bool = False
    twin: nn.Module | None = None
    """A copy of the dense model (``_copy``: its weights shared) until ``add_twin`` runs it."""
    inputs: tuple = ((), {})

    @property
    def single(self) -> list[torch.Tensor]:
        return self.out[:-1]

    @property
    def exact(self) -> torch.Tensor:
        return self.out[-1]

    def single_grads(self, name: str) -> list[torch.Tensor | None]:
        return [g.get(name) for g in self.grads[:-1]]

    def add_twin(self) -> bool:
        """Run the twin (every weight ``tolerance.nudge``d) and insert its output and gradients
        beside the fp32 run's; False when it has already run."""
        if self.twin is None:
            return False
        twin, self.twin = self.twin, None
        g = torch.Generator().manual_seed(0)  # tolerance.nudge(twin), out of place
        with torch.no_grad():
            for p in twin.parameters():
                p.data = tolerance.nudged(p.detach(), g)
        was = _eval(twin)
        try:
            with torch.set_grad_enabled(self.backward):
                out, grads = _run(twin, self.inputs, self.backward)
        finally:
            twin.train(was)
        self.out.insert(1, out)
        self.grads.insert(1, grads)
        return True


_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _weights(shape, device) -> torch.Tensor:
    """The loss's fixed random weights of an output of ``shape`` (float64, seeded): drawn once
    per shape and device for the four runs of a check, not kept after it (``forget_weights``)."""
    key = (tuple(shape), str(device))
    if key not in _WEIGHTS:
        g = torch.Generator().manual_seed(_LOSS_SEED)
        draw = torch.randn(shape, generator=g)  # fp32 draws, exact in float64: 5x cheaper
        _WEIGHTS[key] = draw.to(device=device, dtype=torch.float64)
    return _WEIGHTS[key]


def forget_weights() -> None:
    _WEIGHTS.clear()


def _run(model, inputs, backward: bool, out=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's forward on ``inputs`` (or its output ``out`` of a forward already run),
    then the backward of the loss; returns (the output, the gradients by name, taken)."""
    out = first_tensor(model(*inputs[0], **inputs[1]) if out is None else out)
    if out is None:
        return None, {}
    grads = {}
    if backward and out.requires_grad:
        (out * _weights(out.shape, out.device).to(out.dtype)).sum().backward()
        for n, p in model.named_parameters(remove_duplicate=False):
            if p.grad is not None:  # taken, not copied (a tied name meets it again: kept)
                grads[n] = p.grad.detach()
        for p in model.parameters():
            p.grad = None
    return out.detach().clone(), grads


def _eval(model: nn.Module):
    was = model.training
    model.eval()
    return was


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` sharing its process groups (which cannot be copied), its
    modules' ``config`` objects (read, not changed, by the runs: ``_configs_kept``) and the
    memory of its parameters and buffers (new tensor objects over the same values: nothing
    that splits or runs the model writes into a weight; ``Dense.add_twin`` gives the copy's
    parameters new values of their own)."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach(), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach()
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, dist.ProcessGroup):
                memo[id(v)] = v
        cfg = getattr(m, "config", None)
        if cfg is not None and not isinstance(cfg, (nn.Module, torch.Tensor)):
            memo[id(cfg)] = cfg
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise ValueError(
            f"parallelize: the check needs a copy of the dense {type(model).__name__} (its "
            f"one-rounding twin) and copy.deepcopy failed ({type(exc).__name__}: {exc}); pass "
            "check=False to skip the probe and the check"
        ) from exc


class _configs_kept:
    """Within it, the model's ``config`` objects may change; their attributes are put back on
    exit."""

    def __init__(self, model: nn.Module):
        self.saved = {}
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "__dict__") and id(cfg) not in self.saved:
                self.saved[id(cfg)] = (cfg, dict(vars(cfg)))

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        for cfg, attrs in self.saved.values():
            vars(cfg).clear()
            vars(cfg).update(attrs)


class _promoted:
    """Within it, every floating parameter and buffer of ``model`` holds its own values
    promoted to float64 (and an HF MoE block its eager experts path: ``tolerance.cast``); the
    original tensors, gradients and configs are put back on exit, bit for bit."""

    def __init__(self, model: nn.Module):
        self.model, self.saved = model, []
        self.configs = _configs_kept(model)

    def __enter__(self) -> nn.Module:
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                if t.is_floating_point():
                    self.saved.append((t, t.data, t.grad))
                    t.grad = None
                    t.data = t.data.to(torch.float64)
        tolerance.eager_experts(self.model)
        return self.model

    def __exit__(self, *exc) -> None:
        for t, data, grad in self.saved:
            t.data = data
            t.grad = grad
        self.configs.__exit__(*exc)


def dense_runs(model: nn.Module, inputs, backward: bool, out=None) -> Dense | None:
    """The fp32 run and the float64 run on ``model`` itself (its values promoted in place and
    put back, its gradients left as they were), and a copy of it for the twin (run only when
    asked: ``Dense.add_twin``); None when the model returns no floating tensor (nothing to
    compare). ``out``: the fp32 forward's output where it has run (the probe's, in eval mode,
    with gradients when ``backward``)."""
    ref = Dense(backward=backward, inputs=inputs)
    old_grads = {id(p): p.grad for p in model.parameters()}
    was = _eval(model)
    try:
        with torch.set_grad_enabled(backward):
            for p in model.parameters():
                p.grad = None
            out, grads = _run(model, inputs, backward, out)
            for p in model.parameters():
                p.grad = old_grads[id(p)]
            if out is None:
                return None
            ref.out.append(out)
            ref.grads.append(grads)
            ref.twin = _copy(model)
            for p in ref.twin.parameters():
                p.grad = None
            with _promoted(model):
                args, kwargs = tree_map_float(inputs, torch.float64)
                for r in _run(model, (args, kwargs), backward):
                    (ref.out if isinstance(r, torch.Tensor) else ref.grads).append(r)
    finally:
        model.train(was)
    tokens = out.numel() // max(out.shape[-1], 1) if out.dim() else 1
    widest = max((max(p.shape) for p in model.parameters() if p.dim()), default=1)
    ref.length = max(tokens, widest, 1)
    return ref


_SIMPLE = (int, float, bool, str, type(None))


def _simple_attrs(module: nn.Module) -> dict[str, object]:
    """The plain values a module keeps (head counts, a sliding window, a flag): what may make
    two blocks with equal parameters compute otherwise."""
    out = {}
    for k, v in vars(module).items():
        if k.startswith("_") or k == "training":
            continue
        if isinstance(v, _SIMPLE) or (
            isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v)
        ):
            out[k] = v
        elif callable(v) and not isinstance(v, (nn.Module, torch.Tensor, type)):
            # a function kept as an attribute (an activation): by name, else by identity
            qual = getattr(v, "__qualname__", None)
            out[k] = (getattr(v, "__module__", None), qual) if qual else ("id", id(v))
    return out


def _numbers(values: list) -> bool:
    """Whether ``values`` (one per child, in order) number the children: n, n + 1, ..."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    return ints and values == list(range(values[0], values[0] + len(values)))


def distinct_blocks(model: nn.Module, chosen: Mapping[str, tuple]) -> dict[str, dict[str, str]]:
    """{name of an outermost ``nn.ModuleList``: {child's key: the key of the first child of its
    kind}} for the lists whose children repeat. Two children are of a kind when they have the
    same class, submodules, parameter shapes and dtypes, buffers (values too), planned styles
    and plain attributes (values, tuples of them, functions; one that numbers the children,
    as ``layer_idx``, left out). The probe and the
    check run on the first child of each kind only (``only``); what the probe finds for it
    holds for its copies (``to_copies``)."""
    out: dict[str, dict[str, str]] = {}
    inside: list[str] = []
    for name, lst in model.named_modules():
        if not isinstance(lst, nn.ModuleList) or len(lst) < 2:
            continue
        if any(name == p or name.startswith(p + ".") for p in inside):
            continue  # inside a list already considered (experts inside a block: all kept)
        inside.append(name)
        children = list(lst._modules.items())
        attrs = {
            k: {(rel, a): v for rel, m in c.named_modules() for a, v in _simple_attrs(m).items()}
            for k, c in children
        }
        keys = set().union(*(a.keys() for a in attrs.values()))
        numbering = {  # an attribute that counts the children (layer_idx): not their kind
            key for key in keys if _numbers([a.get(key) for a in attrs.values()])
        }
        first: dict = {}  # kind -> [(key, buffers)] of the first child of each kind
        rep = {}
        for k, c in children:
            prefix = f"{name}.{k}" if name else k
            kind = (
                type(c),
                tuple((rel, type(m)) for rel, m in c.named_modules()),
                tuple(
                    (rel, tuple(p.shape), p.dtype, p.requires_grad)
                    for rel, p in c.named_parameters(remove_duplicate=False)
                ),
                tuple((rel, tuple(b.shape), b.dtype) for rel, b in c.named_buffers()),
                tuple(
                    (n[len(prefix) :], repr(style))
                    for n, style in chosen.items()
                    if n == prefix or n.startswith(prefix + ".")
                ),
                tuple(
                    sorted(
                        (repr(key), repr(v)) for key, v in attrs[k].items() if key not in numbering
                    )
                ),
            )
            buffers = [b for _, b in c.named_buffers()]
            same = [  # equal buffer values too (a per-block table of numbers)
                r
                for r, theirs in first.get(kind, [])
                if all(torch.equal(a, b) for a, b in zip(buffers, theirs, strict=True))
            ]
            if not same:
                first.setdefault(kind, []).append((k, buffers))
            rep[k] = same[0] if same else k
        if len(set(rep.values())) < len(children):
            out[name] = rep
    return out


def to_copies(names, blocks: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """{name: the name it stands for}: each of ``names`` under a kept child of ``blocks``, and
    the same name under each copy of that child."""
    out = {n: n for n in names}
    for lst, rep in blocks.items():
        for key, first in rep.items():
            if key == first:
                continue
            head, other = f"{lst}.{first}" if lst else first, f"{lst}.{key}" if lst else key
            for n in names:
                if n == head or n.startswith(head + "."):
                    out[other + n[len(head) :]] = n
    return out


class only:
    """Within it, each ``nn.ModuleList`` named in ``blocks`` (``distinct_blocks``) holds only
    the first child of each kind, under its own key (parameter names unchanged); restored on
    exit."""

    def __init__(self, model: nn.Module, blocks: Mapping[str, Mapping[str, str]]):
        self.model, self.blocks, self.saved = model, blocks, []

    def __enter__(self) -> None:
        modules = dict(self.model.named_modules())
        for name, keep in self.blocks.items():
            lst = modules[name]
            self.saved.append((lst, lst._modules))
            lst._modules = {k: v for k, v in lst._modules.items() if keep.get(k) == k}

    def __exit__(self, *exc) -> None:
        for lst, children in self.saved:
            lst._modules = children
        self.saved.clear()


def tree_map_float(inputs, dtype):
    """(args, kwargs) with their floating tensors cast to ``dtype`` (token ids stay)."""

    def cast(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        return v

    args, kwargs = inputs
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the dense ``full`` per ``p``'s mark (zeros where ``p`` is padded);
    None where ``p``'s shape cannot be a part of it."""
    ex = expert_layout(p)
    if ex is not None and ex.group is not None and full.dim() and full.shape[0] == ex.num_experts:
        n = p.shape[0]  # dim 0: this EP rank's experts
        full = full.narrow(0, group_rank(ex.group) * n, n)
    layout = param_layout(p)
    if layout is None or layout.kind != "sharded":
        return full if full.shape == p.shape else None
    d, size, fused = layout.dim, layout.full_size, layout.fused
    rank, n = group_rank(layout.group), p.shape[d]
    i = torch.arange(n)
    if fused > 1:
        per = n // fused
        g = (i // per) * (size // fused) + rank * per + i % per
    else:
        g = rank * n + i
    if full.dim() <= d or full.shape[d] != size:
        return None
    if fused == 1 and (rank + 1) * n <= size:  # a plain slice, no padding: a view
        part = full.narrow(d, rank * n, n)
        return part if part.shape == p.shape else None
    part = full.index_select(d, g.clamp(max=size - 1).to(full.device))
    shape = [1] * full.dim()
    shape[d] = n
    part = part * (g < size).view(shape).to(part.device, part.dtype)
    return part if part.shape == p.shape else None


@dataclass
class Verdict:
    """The check's result: the output's comparison and, per compared parameter, its gradient's
    comparison (and the spread across TP ranks of a replicated one, as a ratio to its bound)."""

    output: tolerance.Comparison | None = None
    grads: dict[str, tolerance.Comparison] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)
    unchecked: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    """"output" and each compared parameter -> error / bound, the largest over the TP ranks."""


def _gather_last(got: torch.Tensor, dense: torch.Tensor, tp_group, world: int) -> torch.Tensor:
    if got.shape != dense.shape and got.shape[:-1] == dense.shape[:-1] and world > 1:
        parts = [torch.empty_like(got) for _ in range(world)]
        plain.all_gather(parts, got.detach().contiguous(), group=tp_group)
        return torch.cat(parts, -1)[..., : dense.shape[-1]]
    return got.detach()


def parallel_run(model, inputs, ref: Dense, tp_group, world: int, own=frozenset()) -> Verdict:
    """The parallel ``model`` on the probe input (eval mode; backward when ``ref.backward``),
    compared with ``ref``; every rank returns the same verdict (ratios max-reduced over TP).
    ``own``: parameters this rank alone holds (per-head modules sliced with the heads). Judged
    on the fp32 run's error first; where a quantity is over its bound, again with the twin's
    (``Dense.add_twin``: the same verdict as judging on both at once, at a fourth run's cost
    only where it can change it)."""
    named = dict(model.named_parameters())
    old_grads = {n: p.grad for n, p in named.items()}
    was = _eval(model)
    try:
        with torch.set_grad_enabled(ref.backward):
            for p in named.values():
                p.grad = None
            got = first_tensor(model(*inputs[0], **inputs[1]))
            if got is None:
                raise ValueError(
                    "the parallel model returned no floating tensor on the probe input"
                )
            dense = ref.out[0]
            full = _gather_last(got, dense, tp_group, world)
            if ref.backward and got.requires_grad:
                w = _weights(dense.shape, got.device)
                if got.shape != dense.shape:  # split over the last dim: this rank's columns
                    per, rank = got.shape[-1], group_rank(tp_group)
                    pad = per * world - dense.shape[-1]
                    w = torch.cat([w, w.new_zeros((*w.shape[:-1], pad))], -1)
                    w = w[..., rank * per : (rank + 1) * per]
                (got * w.to(got.dtype)).sum().backward()
            verdict = _judge(full, named, ref, tp_group, world, own, got.requires_grad)
            over = max([*verdict.ratios.values(), *verdict.spread.values()]) > 1
            if over and ref.add_twin():  # (the ratios are max-reduced: the same on every rank)
                verdict = _judge(full, named, ref, tp_group, world, own, got.requires_grad)
            for n, p in named.items():
                p.grad = old_grads[n]
    finally:
        model.train(was)
    return verdict


def _judge(full, named, ref: Dense, tp_group, world: int, own, grads: bool) -> Verdict:
    """The verdict on this rank's output and gradients, every ratio max-reduced over TP in one
    collective, with each replicated gradient's spread across the TP ranks: max(g) + max(-g)
    over its bound (the smallest of the ranks' bounds: the largest ratio)."""
    verdict = Verdict()
    verdict.output = tolerance.compare(
        full, ref.single, ref.exact, length=ref.length, what="output"
    )
    copies = _grads(named, ref, verdict, world, own) if ref.backward and grads else {}
    names = list(verdict.grads)  # the model's order: the same length on every rank
    ratios = [verdict.output.ratio] + [verdict.grads[n].ratio for n in names]
    spread = dict.fromkeys(names, 0.0)
    if world > 1:
        n, k = len(ratios), len(copies)
        flat = torch.cat([g.double().reshape(-1) for g in copies.values()]) if copies else None
        head = [*ratios, *(-verdict.grads[name].bound for name in copies)]
        t = torch.tensor(head, dtype=torch.float64, device=full.device)
        t = torch.cat([t, flat, -flat]) if flat is not None else t
        plain.all_reduce(t, op=dist.ReduceOp.MAX, group=tp_group)
        ratios, bounds = t[:n].tolist(), (-t[n : n + k]).tolist()
        if flat is not None:
            hi, lo = t[n + k : n + k + flat.numel()], t[n + k + flat.numel() :]
            parts = (hi + lo).split([g.numel() for g in copies.values()])
            for name, part, bound in zip(copies, parts, bounds, strict=True):
                top = float(part.max()) if part.numel() else 0.0
                spread[name] = top / bound if bound > 0 else float(top > 0) * 1e30
    verdict.ratios = dict(zip(["output", *names], ratios, strict=True))
    verdict.spread = spread
    return verdict


def _grads(named, ref: Dense, verdict: Verdict, world: int, own) -> dict[str, torch.Tensor]:
    """Each gradient of this rank against its part of the dense ones, into ``verdict``;
    returns the replicated ones (equal on every TP rank: their spread is measured)."""
    exact = ref.grads[-1]
    copies: dict[str, torch.Tensor] = {}
    for name, p in named.items():
        if not p.requires_grad:
            continue
        if name not in exact:
            verdict.unchecked.append(name)
            continue
        parts = [_local(t, p) if t is not None else None for t in ref.single_grads(name)]
        parts.append(_local(exact[name], p))
        if any(t is None for t in parts):
            verdict.unchecked.append(name)
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        ex = expert_layout(p)
        if ex is not None and ex.group is not None and group_size(ex.group) > 1:
            # every EP rank sends this expert the same probe tokens: ep times the dense sum
            grad = grad / group_size(ex.group)
        cmp = tolerance.compare(grad, parts[:-1], parts[-1], length=ref.length, what=name)
        verdict.grads[name] = cmp
        layout = param_layout(p)
        if world > 1 and name not in own and (layout is None or layout.kind == "replicated"):
            copies[name] = grad.detach()
    return copies


def refuse(verdict: Verdict, model: nn.Module, per_head, whole=()) -> None:
    """ValueError naming the first disagreeing quantity and its likely cause; None if all
    agree. ``per_head``: the parameters that see only this rank's heads; ``whole``: those of
    modules planned "replicate" (whole activations), the likeliest source of a shared one."""
    out = verdict.ratios.get("output", 0.0)
    bad = [n for n, r in verdict.ratios.items() if n != "output" and r > 1]
    spread = [n for n, r in verdict.spread.items() if r > 1]
    if out <= 1 and not bad and not spread:
        return
    # a per-head parameter that disagrees is the likeliest culprit; else the one nearest the
    # output (last in the model's order), nearest the defect
    wrong = list(dict.fromkeys(bad + spread))
    heads = [n for n in wrong if n in per_head]
    shared = [n for n in wrong if n in whole]
    name = heads[0] if heads else shared[-1] if shared else wrong[-1] if wrong else None
    cause = (
        "a per-head parameter (a module kept per head, e.g. a ModuleList of norms paired "
        "with the heads by position) that the split pairs with another rank's heads: "
        "slice it with the heads, or leave that attention module whole"
    )
    if not heads:
        cause = (
            "the parameters upstream of a module whose output is shared by every local head (as "
            "MLA's rope key k_rot, broadcast into each head) get only this rank's heads' share "
            "of its gradient: that activation needs a copy-to-region (identity forward, "
            "all-reduce backward; fastpar.comm.copy_to_region) where it enters the heads (the "
            "probe gives it to an nn.Linear whose last output features the heads read; plan "
            "another such module ('shared_key', {'features': k})), or leave that attention "
            "module whole (do not split it)"
        )
    others = [n for n in wrong if n != name]
    listed = f"; {len(others)} more disagree, e.g. {others[:3]}" if others else ""
    grad = ""
    if name is not None:
        across = verdict.spread.get(name, 0.0)
        grad = (
            f"the gradient of {name!r} differs from the dense model's ({verdict.grads[name]})"
            + (
                f" and its copies differ across the TP ranks ({across:.3g} x its bound)"
                if across > 1
                else ""
            )
            + listed
        )
    if out > 1:
        raise ValueError(
            f"parallelize: on the probe input the parallel model's output differs from the dense "
            f"model's ({verdict.output}; error/bound {out:.3g} over the TP ranks): the plan changes "
            f"what {type(model).__name__} computes (a head count or width the model reads "
            "elsewhere? pass heads=)"
            + (f"; {grad}. Likely cause: {cause}" if heads else (f"; {grad}" if grad else ""))
        )
    raise ValueError(
        f"parallelize: on the probe input {grad}. Likely cause: {cause}. The forward may agree "
        "while the gradients do not; check='forward' skips this check (not advised)"
    )


class tracking:
    """Within it, ``where`` (the object it gives) lists the modules running, outermost first:
    after an exception, the path down to the module that raised."""

    def __init__(self, model: nn.Module):
        self.model, self.stack, self.handles = model, [], []

    def __enter__(self) -> list[tuple[str, nn.Module]]:
        for name, m in self.model.named_modules():

            def enter(mod, _args, name=name):
                self.stack.append((name, mod))

            def leave(mod, _args, _out):
                if self.stack:
                    self.stack.pop()

            self.handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
        return self.stack

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


_RESHAPE = ("shape '", "is invalid for input of size", "view size", "expanded size", "must match")
_FUSED = ("qkv", "query_key_value", "gate_up", "c_attn", "w_pack", "fused", "in_proj")
_DIVIDED = ("num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_head")
_NOT_DIVIDED = ("head_dim", "max_position_embeddings", "rotary_ndims", "rope_dim")


def _undivided(module: nn.Module, world: int) -> list[str]:
    """Integer attributes of ``module`` the split may have left undivided (head counts and
    widths; those parallelize divides, and per-head sizes, left out), head counts first."""
    names = [
        a
        for a, v in vars(module).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v > 1
        and v % world == 0
        and not a.startswith("_")
        and a not in _DIVIDED + _NOT_DIVIDED
        and any(k in a for k in ("head", "dim", "size", "emb", "width"))
    ]
    return sorted(names, key=lambda a: "head" not in a)


def failed_message(model: nn.Module, where, exc: Exception, world: int, split=()) -> str:
    """What to say when the parallel model raised on the probe input where the dense one ran:
    the module that raised, the likely cause and the fix that applies (``split``: the planned
    modules whose output is split)."""
    if isinstance(exc, ValueError) and str(exc).startswith("parallelize:"):
        return str(exc)
    name, module = where[-1] if where else ("", model)
    msg = str(exc)
    at = f"module {name or '<model>'!r} ({type(module).__name__})"
    nums = {int(x) for x in re.findall(r"\d+", msg)}
    # the enclosing module whose projections the plan splits (the attention or MLP block)
    block = next(
        (n for n, _ in reversed(where) if any(s.rpartition(".")[0] == n for s in split)), None
    )
    fused = [
        s
        for s in split
        if s.rpartition(".")[0] == block and any(k in s.rpartition(".")[2].lower() for k in _FUSED)
    ]
    wide = [
        (p_name, p.shape[-1])
        for p_name, p in module.named_parameters(recurse=False)
        if p.dim() and p.shape[-1] % world == 0 and {p.shape[-1], p.shape[-1] // world} <= nums
    ]
    whole = f"leave {block or 'the block'!r} whole (drop its projections from the plan)"
    attrs, owner = [], name
    for n, m in reversed(where):
        if attrs := _undivided(m, world):
            owner = n
            break
    reshape = any(k in msg for k in _RESHAPE)
    if wide:
        p_name, width = wide[0]
        hint = (
            f"{name!r} applies its {p_name!r} of width {width} (every head's features) to this "
            f"rank's share ({width // world}): a norm or scale over the whole projection "
            f"(statistics across all heads) cannot be split exactly; {whole}"
        )
    elif reshape and attrs and ("head" in attrs[0] or not fused):
        pattern = f"*.{owner.rpartition('.')[2]}" if owner else ""
        hint = (
            "it reshapes a split activation with a head count or width the split did not "
            f"divide: pass heads={{{pattern!r}: [{attrs[0]!r}]}} (candidates on {owner!r}: "
            f"{attrs})"
            + (
                f"; if {fused[0]!r} is a fused q|k|v, plan it ('column', {{'fused': 3}})"
                if fused
                else ""
            )
            + f"; or {whole}"
        )
    elif fused:
        hint = (
            f"{fused[0]!r} is a fused projection (q|k|v or gate|up in one linear): a plain "
            "'column' split gives each rank a contiguous part of it, not its share of every "
            "block; plan it ('column', {'fused': k}) when its k blocks are of equal width (its "
            f"row partner stays 'row'), else {whole}"
        )
    elif reshape:
        hint = (
            "it reshapes a split activation with a head count or width the split did not "
            f"divide: pass heads= naming the attribute to divide; or {whole}"
        )
    else:
        hint = f"pass heads= naming any head count or width the model reads, or {whole}"
    return (
        f"parallelize: the parallel {type(model).__name__} failed on the probe input where the "
        f"dense one ran, in {at}: {type(exc).__name__}: {msg}. Likely cause: {hint}"
    )
