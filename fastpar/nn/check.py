"""``parallelize``'s own check: the dense model (fp32, its one-rounding twin and a float64 copy)
and the parallel one on the probe input, forward and backward, judged by ``fastpar.tolerance``'s
rule: the output, and every parameter's gradient against its slice of the dense gradient
(replicated ones also equal across the TP ranks). Equal-at-init parameters (norms at 1, biases
at 0) are perturbed first, on every rank alike, and restored exactly afterwards, so a per-head
mix-up cannot hide behind equal values (docs/hf.md, "The check")."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from fastpar import tolerance
from fastpar.comm import plain
from fastpar.mesh.placement import expert_layout, param_layout
from fastpar.mesh.ranks import group_rank, group_size
from fastpar.nn.exact import Rows, promoted, tree_map_float

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
    """The dense runs on the probe input: the float64 run's output and gradients (by name; the
    probe's run, ``dense_runs``), after the fp32 run's and the twin's once they have run;
    ``length``: the longest reduction (the rule's n). The fp32 run and the twin run only when
    asked (``add_grads``, ``add_twin``): a quantity within the rule's floor alone is within its
    bound on the fp32 run's error, and one within that bound is within it on the larger of the
    fp32 and twin runs' errors too."""

    out: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    length: int = 1
    backward: bool = False
    copy: nn.Module | None = None
    """A copy of the dense model (``_copy``: its weights shared) for the runs asked later."""
    inputs: tuple = ((), {})
    runs: int = 0
    """The later runs made: 1 after ``add_grads``, 2 after ``add_twin``."""

    @property
    def single(self) -> list[torch.Tensor]:
        return self.out[:-1]

    @property
    def exact(self) -> torch.Tensor:
        return self.out[-1]

    def single_grads(self, name: str) -> list[torch.Tensor | None]:
        return [g.get(name) for g in self.grads[:-1]]

    def add_grads(self) -> bool:
        """Run the copy in fp32 (forward, and backward when the check has one) and insert its
        output and gradients before the float64 run's; False when it has run already."""
        if self.runs > 0 or self.copy is None:
            return False
        self.runs = 1
        out, grads = self._run_copy()
        self.out.insert(0, out)
        if self.backward:
            self.grads.insert(0, grads)
        return True

    def add_twin(self) -> bool:
        """Run the twin (the copy, every weight ``tolerance.nudge``d) and insert its output and
        gradients beside the fp32 run's (which it runs first, where it has not run); False when
        it has already run."""
        if self.runs > 1 or self.copy is None:
            return False
        self.add_grads()
        self.runs = 2
        g = torch.Generator().manual_seed(0)  # tolerance.nudge(copy), out of place
        with torch.no_grad():
            for p in self.copy.parameters():
                p.data = tolerance.nudged(p.detach(), g)
        out, grads = self._run_copy()
        self.copy = None
        self.out.insert(1, out)
        if self.backward:
            self.grads.insert(1, grads)
        return True

    def _run_copy(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        was = _eval(self.copy)
        try:
            with torch.set_grad_enabled(self.backward):
                return _run(self.copy, self.inputs, self.backward)
        finally:
            self.copy.train(was)


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


def _call(model, inputs):
    return model(*inputs[0], **inputs[1])


def _run(
    model, inputs, backward: bool, forward=_call
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``forward(model, inputs)`` (the model's own forward by default), then the backward of the
    loss; returns (the output, the gradients by name, taken)."""
    out = first_tensor(forward(model, inputs))
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
    modules' ``config`` objects (read, not changed, by the runs: ``exact.configs_kept``) and the
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


def dense_runs(
    model: nn.Module, inputs, backward: bool = False, forward=_call, whole=frozenset()
) -> Dense | None:
    """The float64 run on ``model`` itself (its values promoted in place and put back, its
    gradients left as they were; ``forward(model, inputs)`` runs it: parallelize's probe), and a
    copy of the model for the runs asked later (``Dense.add_grads``, ``Dense.add_twin``); None
    when the model returns no floating tensor (nothing to compare). ``backward``: gradients
    too. ``whole``: ids of parameters the float64 run must promote whole (``exact.promoted``)."""
    ref = Dense(backward=backward, inputs=inputs)
    was = _eval(model)
    try:
        with torch.set_grad_enabled(backward):
            old_grads = {id(p): p.grad for p in model.parameters()}
            for p in model.parameters():
                p.grad = None
            try:
                exact, grads = _exact_run(model, inputs, backward, forward, whole)
            finally:
                for p in model.parameters():
                    p.grad = old_grads[id(p)]
        if exact is None:
            return None
        ref.out.append(exact)
        ref.grads.append(grads)
        ref.copy = _copy(model)
        for p in ref.copy.parameters():
            p.grad = None
    finally:
        model.train(was)
    tokens = exact.numel() // max(exact.shape[-1], 1) if exact.dim() else 1
    widest = max((max(p.shape) for p in model.parameters() if p.dim()), default=1)
    ref.length = max(tokens, widest, 1)
    return ref


def _exact_run(model: nn.Module, inputs, backward: bool, forward=_call, whole=frozenset()):
    """``_run`` in float64 (``exact.promoted``): its plain embedding tables looked up row by
    row, unless a table is read outside its own lookup (an error, a gradient of its own, or a
    result that is not float64): then again with every value promoted."""
    args = tree_map_float(inputs, torch.float64)
    run64 = promoted(model, whole=whole)
    if run64.compact:
        try:
            with run64:
                out, grads = _run(model, args, backward, forward)
            if out is None or (
                out.dtype == torch.float64 and not any(n in grads for n in run64.compact)
            ):
                return out, {**grads, **run64.row_grads()}
        except Exception:
            pass
        for p in model.parameters():
            p.grad = None
        run64 = promoted(model, compact=False)
    with run64:
        return _run(model, args, backward, forward)


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the dense ``full`` per ``p``'s mark (zeros where ``p`` is padded);
    None where ``p``'s shape cannot be a part of it. ``Rows`` (a compact table's gradient,
    ``exact.promoted``) are made dense: this rank's rows alone where ``p`` is a plain slice
    of dim 0, else the whole table."""
    if isinstance(full, Rows):
        part = _rows_part(full, p)
        if part is not None:
            return part
        full = full.part(0, full.shape[0])
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


def _rows_part(full: Rows, p: torch.Tensor) -> torch.Tensor | None:
    """This rank's rows of ``full`` as a dense tensor of ``p``'s shape (its padding rows zero)
    where ``p`` is the whole table or a plain dim-0 slice of it; None otherwise."""
    layout = param_layout(p)
    if expert_layout(p) is not None or tuple(p.shape[1:]) != tuple(full.shape[1:]):
        return None
    if layout is None or layout.kind != "sharded":
        return full.part(0, p.shape[0]) if p.shape[0] == full.shape[0] else None
    if layout.dim == 0 and layout.fused == 1 and layout.full_size == full.shape[0]:
        return full.part(group_rank(layout.group) * p.shape[0], p.shape[0])
    return None


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


def _in_place_of(got: torch.Tensor, exact: torch.Tensor, tp_group, world: int) -> torch.Tensor:
    """``got`` as a tensor of the dense output's shape: itself, or (an output split over its
    last dim) this rank's columns written over the float64 ``exact``, whose other columns have
    no error; the largest error over the TP ranks (the judge's max-reduction) is then the
    gathered output's, against the same bound, with no gather."""
    if got.shape == exact.shape or got.shape[:-1] != exact.shape[:-1] or world == 1:
        return got.detach()
    per, rank = got.shape[-1], group_rank(tp_group)
    lo = min(rank * per, exact.shape[-1])
    n = min(per, exact.shape[-1] - lo)  # the padding columns past the dense width: dropped
    out = exact.clone()
    out[..., lo : lo + n] = got.detach()[..., :n]
    return out


def parallel_run(model, inputs, ref: Dense, tp_group, world: int, own=frozenset()) -> Verdict:
    """The parallel ``model`` on the probe input (eval mode; backward when ``ref.backward``),
    compared with ``ref``; every rank returns the same verdict (ratios max-reduced over TP).
    ``own``: parameters this rank alone holds (per-head modules sliced with the heads). The
    gradients are judged on the rule's floor first, then, where a quantity is over it, on the
    fp32 run's error (``Dense.add_grads``), then on the twin's too (``Dense.add_twin``): the
    same verdict as judging on all at once, each run made only where it can change it."""
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
            dense = ref.exact
            full = _in_place_of(got, ref.exact, tp_group, world)
            if ref.backward and got.requires_grad:
                w = _weights(dense.shape, got.device)
                if got.shape != dense.shape:  # split over the last dim: this rank's columns
                    per, rank = got.shape[-1], group_rank(tp_group)
                    pad = per * world - dense.shape[-1]
                    w = torch.cat([w, w.new_zeros((*w.shape[:-1], pad))], -1)
                    w = w[..., rank * per : (rank + 1) * per]
                (got * w.to(got.dtype)).sum().backward()
            verdict = _judge(full, got, named, ref, tp_group, world, own)
            # judged on the floor first, then on the fp32 run's error, then also on the twin's:
            # each step only where the last left a quantity over its bound (the ratios are
            # max-reduced: every rank takes the same steps)
            for more in (ref.add_grads, ref.add_twin):
                if max([*verdict.ratios.values(), *verdict.spread.values()]) <= 1:
                    break
                if more():
                    verdict = _judge(full, got, named, ref, tp_group, world, own)
            for n, p in named.items():
                p.grad = old_grads[n]
    finally:
        model.train(was)
    return verdict


def _judge(full, got, named, ref: Dense, tp_group, world: int, own) -> Verdict:
    """The verdict on this rank's output (``full``: ``got`` in the dense output's shape,
    ``_in_place_of``) and gradients, every ratio max-reduced over TP in one collective, with
    each replicated gradient's spread across the TP ranks: max(g) + max(-g) over its bound (the
    smallest of the ranks' bounds: the largest ratio). The output's error is then the largest
    over the ranks (its bound is the same on each)."""
    verdict = Verdict()
    verdict.output = tolerance.compare(
        full, ref.single, ref.exact, length=ref.length, dtype=got.dtype, what="output"
    )
    grads = ref.backward and got.requires_grad
    copies = _grads(named, ref, verdict, world, own) if grads else {}
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
        if verdict.output.bound > 0:
            verdict.output = replace(verdict.output, error=ratios[0] * verdict.output.bound)
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
        dtype = None if len(parts) > 1 else grad.dtype  # no fp32 run yet: the floor alone
        cmp = tolerance.compare(
            grad, parts[:-1], parts[-1], length=ref.length, dtype=dtype, what=name
        )
        verdict.grads[name] = cmp
        layout = param_layout(p)
        if world > 1 and name not in own and (layout is None or layout.kind == "replicated"):
            copies[name] = grad.detach()
    return copies
