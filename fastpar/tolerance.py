"""When two runs of the same math agree: a tolerance from an fp64 reference, not from a machine.

    agree ⇔ |actual - exact| <= FACTOR · max |single - exact| + floor + slack   (every element)

``check_parallel``, ``fastpar.verify`` and the parity tests judge by this rule; its derivation:
docs/tolerances.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FACTOR = 4.0
"""How many times the single-process run's own error a parallel run may be off by."""
FLOOR = 4.0
"""The floor in units of ``u(dtype) · sqrt(length) · max |exact|``."""
ADAM_FACTOR = 4.0
"""``adam_slack``'s bound on AdamW's sensitivity, in units of lr / (sqrt(v̂) + eps)."""

_UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype`` (the largest relative error of
    one rounding)."""
    if dtype not in _UNIT_ROUNDOFF:
        raise ValueError(
            f"no unit roundoff for {dtype}: compare floating-point tensors "
            f"({', '.join(str(d) for d in _UNIT_ROUNDOFF)})"
        )
    return _UNIT_ROUNDOFF[dtype]


def floor(dtype: torch.dtype, length: int, scale: float) -> float:
    """``FLOOR · (u(dtype) + u(accumulation) · sqrt(length)) · scale``: the error allowed
    whatever the single run's — one rounding of the result to ``dtype`` plus a sum of
    ``length`` terms accumulated in fp32 (float64 for float64)."""
    if length < 1:
        raise ValueError(f"length (the longest reduction) must be >= 1, got {length}")
    acc = unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)
    return FLOOR * (unit_roundoff(dtype) + acc * math.sqrt(length)) * scale


def errors(x: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|x - exact| elementwise in float64: equal values (infinities alike) and NaN-for-NaN are
    0, a non-finite value against a finite one is inf."""
    b = exact.detach().to(device=x.device, dtype=torch.float64)
    # x promoted first: a float64 subtraction of two float64 tensors is several times faster
    # than one that promotes element by element, and gives the same values
    diff = torch.sub(x.detach().to(torch.float64), b).abs_()
    if diff.numel() == 0 or torch.isfinite(diff.max()):  # no inf or NaN on either side
        return diff
    a, b = x.detach().double(), exact.detach().double().to(x.device)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    return torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)


_CHUNK = 1 << 16  # float64 elements a chunk of ``max_error`` works on: it stays in cache


def max_error(x: torch.Tensor, exact: torch.Tensor) -> float:
    """max ``errors(x, exact)`` (inf for another shape, 0 for an empty tensor)."""
    if tuple(x.shape) != tuple(exact.shape):
        return math.inf
    return _max_errors([x], exact)[0][0]


def _max_errors(xs, exact: torch.Tensor) -> tuple[list[float], float]:
    """(``max_error(x, exact)`` for each of ``xs``, all of ``exact``'s shape; ``magnitude(exact)``)
    in one pass: on a CPU through chunks that stay in cache (whole tensors of differences in
    float64 cost new memory pages, several times the subtraction). Where a value is not finite
    ``errors`` and ``magnitude`` decide."""
    ref = exact.detach().reshape(-1)
    n = ref.numel()
    if n == 0:
        return [0.0] * len(xs), 0.0
    flats = [x.detach().reshape(-1).to(ref.device) for x in xs]
    step = _CHUNK if ref.device.type == "cpu" else n
    work = torch.empty(min(step, n), dtype=torch.float64, device=ref.device)
    wide = ref.dtype == torch.float64
    held = work if wide else torch.empty_like(work)
    tops: list[list[torch.Tensor]] = [[] for _ in xs]
    lows, highs = [], []
    for i in range(0, n, step):
        e = ref[i : i + step] if wide else held[: min(step, n - i)].copy_(ref[i : i + step])
        lo, hi = torch.aminmax(e)
        lows.append(lo)
        highs.append(hi)
        chunk = work[: e.numel()]
        for top, x in zip(tops, flats, strict=True):  # max |x - e|: one aminmax, no abs
            d_lo, d_hi = torch.aminmax(chunk.copy_(x[i : i + step]).sub_(e))
            top.append(torch.maximum(d_hi, d_lo.neg()))
    tops_f = [float(torch.stack(t).max()) for t in tops]
    mag = max(-float(torch.stack(lows).min()), float(torch.stack(highs).max()))
    if not all(math.isfinite(v) for v in [*tops_f, mag]):  # (a NaN propagates into the max)
        tops_f = [float(errors(x, exact).max()) for x in xs]
        mag = magnitude(exact)
    return tops_f, mag


def magnitude(exact: torch.Tensor) -> float:
    """max |exact| over its finite values (0 for an empty tensor)."""
    t = exact.detach() if exact.is_floating_point() else exact.detach().double()
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t)  # one pass, no copy
    top = max(-float(lo), float(hi))
    if math.isfinite(top):  # every value finite (NaN propagates into both)
        return top
    t = t.double()[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


@dataclass(frozen=True)
class Comparison:
    """The verdict of the rule on one quantity, at its worst element (the one with the largest
    ``error / bound``): that element's error against float64 and its bound's parts."""

    what: str
    error: float
    single_error: float
    floor: float
    factor: float = FACTOR
    slack: float = 0.0
    """The worst element's ``slack`` (``adam_slack``), 0 when none is allowed."""

    @property
    def bound(self) -> float:
        return self.factor * self.single_error + self.floor + self.slack

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    @property
    def ratio(self) -> float:
        """``error / bound``: at most 1 when the quantity agrees."""
        if self.bound > 0:
            return self.error / self.bound
        return 0.0 if self.error == 0 else math.inf

    def __str__(self) -> str:
        return (
            f"{self.what}: error {self.error:.3g} against fp64, bound {self.bound:.3g} "
            f"(= {self.factor:g} x the single-process error {self.single_error:.3g} + floor "
            f"{self.floor:.3g}{f' + AdamW slack {self.slack:.3g}' if self.slack else ''})"
            f"{'' if self.ok else ' -- DISAGREE'}"
        )


def compare(
    actual: torch.Tensor | float,
    single: torch.Tensor | float | Sequence[torch.Tensor | float],
    exact: torch.Tensor | float,
    *,
    length: int = 1,
    dtype: torch.dtype | None = None,
    what: str = "value",
    factor: float = FACTOR,
    slack: torch.Tensor | float = 0.0,
) -> Comparison:
    """The rule of this module for one quantity: ``actual`` (the run under test) and ``single``
    (the single-process run in the working precision ``dtype``, default ``single``'s dtype; or a
    list or tuple of such runs — say the run and its ``nudge``d twin — whose largest error counts;
    none, with ``dtype`` given: the floor alone) against ``exact`` (the same math in float64);
    ``length``: the longest reduction feeding the quantity; ``slack``: an error allowed on top,
    one number or one per element."""
    singles = list(single) if isinstance(single, (list, tuple)) else [single]
    if not singles and dtype is None:
        raise ValueError(f"{what}: no single-process value to compare with, and no dtype")
    actual, exact = torch.as_tensor(actual), torch.as_tensor(exact)
    singles = [torch.as_tensor(t) for t in singles]
    if dtype is None:
        dtype = singles[0].dtype if singles[0].is_floating_point() else torch.float32
    for t in singles:
        if tuple(t.shape) != tuple(exact.shape):
            raise ValueError(
                f"{what}: the single-process value has shape {tuple(t.shape)}, the fp64 "
                f"reference {tuple(exact.shape)}: compare the same quantity"
            )
    same = tuple(actual.shape) == tuple(exact.shape)
    tops, mag = _max_errors([*singles, actual] if same else singles, exact)
    e_single = max(tops[: len(singles)], default=0.0)
    fl = floor(dtype, length, mag)
    if not same:
        return Comparison(f"{what} (shape {tuple(actual.shape)})", math.inf, e_single, fl, factor)
    if actual.numel() == 0:
        return Comparison(what, 0.0, e_single, fl, factor)
    if not isinstance(slack, torch.Tensor) or slack.dim() == 0:  # one bound for every element
        bound = factor * e_single + fl + float(slack)
        if bound > 0 or tops[-1] == 0:
            return Comparison(what, tops[-1], e_single, fl, factor, float(slack))
    err = errors(actual, exact).reshape(-1)
    extra = torch.as_tensor(slack, dtype=torch.float64).to(err.device)
    extra = extra.expand(exact.shape).reshape(-1) if extra.dim() else extra.expand(err.shape)
    bound = factor * e_single + fl + extra
    # a zero bound allows no error: an element with one is infinitely far (0 * inf would be
    # NaN, and a NaN ratio the worst, so an element without error was reported and passed)
    over = torch.where(err > 0, math.inf, 0.0).to(err.dtype)
    ratio = torch.where(bound > 0, err / bound.clamp(min=1e-300), over)
    at = int(ratio.argmax())
    return Comparison(what, float(err[at]), e_single, fl, factor, float(extra[at]))


def assert_agree(
    actual: torch.Tensor | float,
    single: torch.Tensor | float | Sequence[torch.Tensor | float],
    exact: torch.Tensor | float,
    **options: Any,
) -> Comparison:
    """``compare`` (same arguments: ``length``, ``dtype``, ``what``, ``factor``, ``slack``),
    raising AssertionError (its text) when the quantity does not agree."""
    result = compare(actual, single, exact, **options)
    if not result.ok:
        raise AssertionError(str(result))
    return result


def adam_denominator(exp_avg_sq: torch.Tensor, step: int, beta2: float, eps: float):
    """sqrt(v̂) + eps of one AdamW step (``exp_avg_sq`` after step ``step``, bias-corrected), in
    float64: what the update divided the gradient by."""
    return (exp_avg_sq.double() / (1.0 - beta2**step)).sqrt() + eps


def adam_slack(
    lrs: Sequence[float],
    grad_bounds: Sequence[float],
    denominators: Sequence[torch.Tensor],
    factor: float = ADAM_FACTOR,
) -> torch.Tensor:
    """Per element, how far AdamW steps can move a parameter in a correct run given bounds on
    its gradient's error: ``sum_t factor · lr_t · D_t / denominator_t`` with ``D_t`` the largest
    ``grad_bounds[s]`` for s <= t (an error lingers in the moments) and ``denominator_t`` the
    float64 run's sqrt(v̂) + eps at step t (``adam_denominator``); a step of lr 0 (skipped)
    counts for nothing. Why: docs/tolerances.md ("slack")."""
    if not (len(lrs) == len(grad_bounds) == len(denominators)):
        raise ValueError(
            f"adam_slack: {len(lrs)} learning rates, {len(grad_bounds)} gradient bounds and "
            f"{len(denominators)} denominators: give one of each per step"
        )
    total, worst = None, 0.0
    for lr, g, d in zip(lrs, grad_bounds, denominators, strict=True):
        if lr == 0:  # a skipped step (fp16 overflow): no update, its gradients never entered
            continue
        worst = max(worst, float(g))
        term = factor * lr * worst / d.double()
        total = term if total is None else total + term
    return total if total is not None else torch.zeros(())


def rule_text(dtype: torch.dtype, length: int) -> str:
    """One line that states the rule with its numbers, for a report."""
    name = str(dtype).replace("torch.", "")
    return (
        f"each quantity against the same math in float64: agree when its error is at most "
        f"{FACTOR:g} x the single-process {name} run's own (it and its twin one rounding away) "
        f"+ {FLOOR:g} (u + u32 sqrt(n)) max|value| (u = 2^{round(math.log2(unit_roundoff(dtype)))}"
        f", n = {length}: the longest reduction) + what AdamW makes of the gradients' bounds"
    )


def worst(comparisons) -> Comparison | None:
    """The comparison with the largest ``ratio`` (None for none)."""
    comparisons = list(comparisons)
    return max(comparisons, key=lambda c: c.ratio) if comparisons else None


@torch.no_grad()
def nudge(tensors, seed: int = 0) -> None:
    """Move every floating-point tensor of ``tensors`` (a module's parameters, or an iterable of
    tensors) by one unit in the last place, up or down at random (``seed``), in place: a twin
    of a single-process run that differs from it by one rounding of each starting value. The
    rounding error a computation amplifies shows in the twin as it shows in any correct run
    whose sums are ordered otherwise, so the larger of the two runs' errors is a steadier
    measure of it than either alone (``compare(actual, [single, twin], exact)``)."""
    if isinstance(tensors, torch.nn.Module):
        tensors = tensors.parameters()
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        nudged(t, g, out=t)


@torch.no_grad()
def nudged(t: torch.Tensor, generator: torch.Generator, out=None) -> torch.Tensor:
    """``t`` moved by one unit in the last place, up or down by a fair coin per element drawn
    from ``generator`` (``nudge``'s step for one tensor), into ``out`` (``t`` itself: in place)
    or a new tensor; a tensor that is not floating point, or empty, is returned as it is."""
    if not t.is_floating_point() or t.numel() == 0:
        return t
    # the same draws as randint's default int64 (checked in tests/test_tolerance.py)
    up = torch.randint(0, 2, t.shape, generator=generator, dtype=torch.bool).to(t.device)
    if t.dtype not in (torch.bfloat16, torch.float16):
        toward = torch.empty_like(t).copy_(up).sub_(0.5).mul_(math.inf)  # +-inf, fast
        return torch.nextafter(t, toward, out=out)
    # one ulp of the low precision: the nearest neighbour of the rounded value
    work = t.float()
    ulp = torch.finfo(t.dtype).eps * work.abs().clamp(min=torch.finfo(t.dtype).tiny)
    moved = (work + torch.where(up, ulp, -ulp)).to(t.dtype)
    return moved if out is None else out.copy_(moved)


# -- single-process training, three ways -------------------------------------------------------
@dataclass
class Run:
    """One single-process AdamW run: ``before`` (what the caller computed on the fresh model),
    per step the loss, the gradients by name and AdamW's sqrt(v̂) + eps by name, the final
    parameters by name, and (bf16 moments) ``rounding_slack`` by name: the bound on what a
    moment stored as the neighbouring bf16 value moves each parameter
    (``fastpar.reference.optimizer.ExactAdamW``)."""

    before: Any = None
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    denominators: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    rounding_slack: dict[str, torch.Tensor] = field(default_factory=dict)


def cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)``, and in float64 every Hugging Face MoE block switched to its eager
    per-expert loop: transformers' default experts path on CPU (``torch._grouped_mm``) refuses
    float64, so the exact reference of a Mixtral / Qwen3-MoE model would fail there. The eager
    loop is the same math; a float64 run is the exact reference, not a speed measurement."""
    module = module.to(dtype)
    if dtype == torch.float64:
        eager_experts(module)
    return module


def eager_experts(module: torch.nn.Module) -> None:
    """Switch every Hugging Face MoE block of ``module`` to its eager per-expert loop (the
    one experts path that runs in float64 on a CPU: ``cast``)."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            cfg._experts_implementation = "eager"


def train_run(
    build_model: Callable[[], torch.nn.Module],
    loss: Callable[[torch.nn.Module, int, torch.dtype], torch.Tensor],
    steps: int,
    *,
    dtype: torch.dtype = torch.float32,
    twin: bool = False,
    seed: int = 0,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    eps: float = 1e-8,
    betas: tuple[float, float] = (0.9, 0.999),
    before: Callable[[torch.nn.Module, torch.dtype], Any] | None = None,
) -> Run:
    """``steps`` steps of torch's AdamW (``foreach=False``) on ``build_model()`` (called under
    ``torch.manual_seed(seed)``, then cast to ``dtype``; ``twin``: every weight ``nudge``d),
    each on ``loss(model, step, dtype)``. ``before(model, dtype)`` runs first, on the fresh
    model (its gradients are cleared after it)."""
    torch.manual_seed(seed)
    model = cast(build_model(), dtype)  # float64: HF experts in their eager loop
    if twin:
        nudge(model, seed)
    run = Run()
    if before is not None:
        run.before = before(model, dtype)
        model.zero_grad(set_to_none=True)
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
    )
    for step in range(steps):
        value = loss(model, step, dtype)
        value.backward()
        run.grads.append(
            {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
        )
        opt.step()
        run.denominators.append(
            {
                n: adam_denominator(opt.state[p]["exp_avg_sq"], step + 1, betas[1], eps)
                for n, p in named.items()
                if p in opt.state
            }
        )
        opt.zero_grad(set_to_none=True)
        run.losses.append(float(value.detach()))
    run.params = {n: p.detach().clone() for n, p in named.items()}
    return run


@dataclass
class References:
    """The single-process run in the working precision, its twin and the float64 run of the same
    training (``train_references``), and the rule's verdicts against them: ``loss(step,
    actual)``, ``param(name, actual)`` (with AdamW's slack), ``grad(step, name, actual)``;
    ``local(full, name)`` slices a full tensor the way the caller's copy is held (default: as
    is)."""

    single: Run
    twin: Run
    exact: Run
    length: int
    lr: float | Sequence[float]
    """AdamW's learning rate, or one per step (0 for a step that was skipped)."""
    dtype: torch.dtype = torch.float32
    local: Callable[[torch.Tensor, str], torch.Tensor] | None = None

    def _cut(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return t if self.local is None else self.local(t, name)

    def _compare(self, what, actual, pick, name=None, slack=0.0) -> Comparison:
        ones = [pick(r) for r in (self.single, self.twin)]
        ref = pick(self.exact)
        if name is not None:
            ones, ref = [self._cut(t, name) for t in ones], self._cut(ref, name)
        return compare(
            actual, ones, ref, length=self.length, dtype=self.dtype, what=what, slack=slack
        )

    def loss(self, step: int, actual) -> Comparison:
        return self._compare(f"loss of step {step + 1}", actual, lambda r: r.losses[step])

    def grad(self, step: int, name: str, actual) -> Comparison:
        return self._compare(
            f"{name} (gradient of step {step + 1})", actual, lambda r: r.grads[step][name], name
        )

    def grad_bound(self, step: int, name: str) -> float:
        """The rule's bound on ``name``'s full gradient at ``step`` (0 when it has none)."""
        g = self.exact.grads[step].get(name)
        if g is None:
            return 0.0
        ones = [r.grads[step].get(name, torch.zeros_like(g)) for r in (self.single, self.twin)]
        return compare(ones[0], ones, g, length=self.length, dtype=self.dtype).bound

    def slack(self, name: str) -> torch.Tensor | float:
        """``adam_slack`` for ``name`` (sliced like the caller's copy), plus ``ADAM_FACTOR``
        times the exact run's ``rounding_slack`` (bf16 moments)."""
        rounding = self.exact.rounding_slack.get(name)
        extra = 0.0 if rounding is None else ADAM_FACTOR * self._cut(rounding, name)
        return extra + self._adam_slack(name)

    def _adam_slack(self, name: str) -> torch.Tensor | float:
        steps = range(len(self.exact.grads))
        if not any(name in self.exact.denominators[t] for t in steps):
            return 0.0
        denoms = [self.exact.denominators[t].get(name) for t in steps]
        full = next(d for d in denoms if d is not None)
        denoms = [torch.full_like(full, math.inf) if d is None else d for d in denoms]
        bounds = [self.grad_bound(t, name) for t in steps]
        lrs = [self.lr] * len(bounds) if isinstance(self.lr, (int, float)) else list(self.lr)
        return self._cut(adam_slack(lrs, bounds, denoms), name)

    def param(self, name: str, actual) -> Comparison:
        return self._compare(name, actual, lambda r: r.params[name], name, self.slack(name))


def train_references(
    build_model: Callable[[], torch.nn.Module],
    loss: Callable[[torch.nn.Module, int, torch.dtype], torch.Tensor],
    steps: int,
    *,
    length: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    lr: float = 1e-2,
    **kwargs: Any,
) -> References:
    """The three single-process runs of ``train_run`` (``dtype``, its twin, float64) with the
    same arguments; ``length``: the longest reduction, for the rule's floor."""
    runs = [
        train_run(build_model, loss, steps, dtype=d, twin=t, seed=seed, lr=lr, **kwargs)
        for d, t in ((dtype, False), (dtype, True), (torch.float64, False))
    ]
    return References(*runs, length=length, lr=lr, dtype=dtype)
