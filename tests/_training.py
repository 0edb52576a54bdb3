"""The single-process references of the training tests (data parallel, ZeRO, pipelines, TP x
DP): train the whole model on the whole batch three ways (the working precision, its twin,
float64) and judge a parallel run against them by ``fastpar.tolerance``'s rule:

    refs = references(build, mse_loss(micro, world, 7, 5), steps, make_opt, length=n)
    out = run_ranks(train, world)                   # per rank: (losses, {name: param})
    check_training(refs, out)                       # every loss, every parameter, every rank

``train_run`` takes any optimizer (``fastpar.tolerance.train_run`` only AdamW) and also
records each step's gradient norm (``norm``); ``sliced`` makes the references slice each full
tensor like a sharded parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import local_slice
from torch import nn

from fastpar import tolerance
from fastpar.nn import param_layout

Loss = Callable[[nn.Module, int, torch.dtype], torch.Tensor]


def global_batch(step: int, micro: int, world: int, d_in: int, d_out: int, rows: int = 3):
    """Step ``step``'s batch of every rank (seeded by the step): x ``[micro, world, rows,
    d_in]``, y ``[micro, world, rows, d_out]``; rank r's micro-batch m is ``x[m, r]``."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(micro, world, rows, d_in, generator=g)
    y = torch.randn(micro, world, rows, d_out, generator=g)
    return x, y


def mse_loss(micro: int, world: int, d_in: int, d_out: int) -> Loss:
    """``loss(model, step, dtype)``: the mean squared error on the whole of step ``step``'s
    ``global_batch`` (every rank's every micro-batch), what a data-parallel run splits."""

    def loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
        x, y = global_batch(step, micro, world, d_in, d_out)
        return F.mse_loss(model(x.reshape(-1, d_in).to(dtype)), y.reshape(-1, d_out).to(dtype))

    return loss


@dataclass
class Run(tolerance.Run):
    """``fastpar.tolerance.Run`` and each step's gradient norm before clipping."""

    norms: list[float] = field(default_factory=list)


def train_run(
    build_model: Callable[[], nn.Module],
    loss: Loss,
    steps: int,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    dtype: torch.dtype = torch.float32,
    twin: bool = False,
    seed: int = 0,
    clip: float | None = None,
) -> Run:
    """``fastpar.tolerance.train_run`` for any optimizer: ``steps`` steps of
    ``make_opt(model)`` (SGD, AdamW with param groups, ...) on ``build_model()`` (built under
    ``torch.manual_seed(seed)``, cast to ``dtype``; ``twin``: every weight ``nudge``d), each on
    ``loss(model, step, dtype)``, the gradients clipped to ``clip`` (torch's
    ``clip_grad_norm_``) before the step. Per step: the loss, the gradient norm before clipping,
    the gradients by name as the optimizer sees them (a tied weight under each of its names)
    and, where the optimizer keeps AdamW's ``exp_avg_sq``, its sqrt(v̂) + eps."""
    torch.manual_seed(seed)
    model = build_model().to(dtype)
    if twin:
        tolerance.nudge(model, seed)
    named = dict(model.named_parameters(remove_duplicate=False))
    opt = make_opt(model)
    run = Run()
    for step in range(steps):
        value = loss(model, step, dtype)
        value.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if clip is not None:
            run.norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        else:
            run.norms.append(float(torch.nn.utils.get_total_norm(grads)))
        run.grads.append(
            {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
        )
        opt.step()
        denominators = {}
        inner = getattr(opt, "optimizer", opt)  # a mixed-precision wrapper's: its masters'
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state.get(p, {})
                if "exp_avg_sq" in state:
                    d = tolerance.adam_denominator(
                        state["exp_avg_sq"], int(state["step"]), group["betas"][1], group["eps"]
                    )
                    denominators.update({n: d for n, q in named.items() if q is p})
        run.denominators.append(denominators)
        opt.zero_grad(set_to_none=True)
        run.losses.append(float(value.detach()))
    run.params = {n: p.detach().clone() for n, p in named.items()}
    return run


def references(
    build_model: Callable[[], nn.Module],
    loss: Loss,
    steps: int,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    length: int,
    lr: float = 0.0,
    clip: float | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tolerance.References:
    """The single-process run in the working precision ``dtype``, its twin and the float64 run
    of ``train_run`` (same arguments) as ``fastpar.tolerance.References``: ``.loss(step, v)``,
    ``.grad(step, name, v)``, ``.param(name, v)`` (with AdamW's slack; ``lr``: AdamW's largest
    learning rate, unused for other optimizers) and ``norm(refs, step, v)`` here; ``length``:
    the longest reduction."""
    runs = [
        train_run(build_model, loss, steps, make_opt, dtype=d, twin=t, seed=seed, clip=clip)
        for d, t in ((dtype, False), (dtype, True), (torch.float64, False))
    ]
    exact = runs[-1]  # a NaN there would make the single runs' errors, and every bound, inf
    values = [torch.tensor(exact.losses), *exact.params.values()]
    values += [g for grads in exact.grads for g in grads.values()]
    assert all(bool(torch.isfinite(v).all()) for v in values), "the float64 run is not finite"
    return tolerance.References(*runs, length=length, lr=lr, dtype=dtype)


def _tp_loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    return F.mse_loss(model(x.reshape(-1, 8).to(dtype)), y.reshape(-1, 8).to(dtype))


def tp_references(build: Callable[[], nn.Module], steps: int) -> tolerance.References:
    """``steps`` steps of torch's AdamW (lr 1e-2) with the gradients clipped to 0.5 on the dense
    ``build()`` (8 features in and out) and a batch of 2 x 4 rows (one half per DP replica of
    the TP x DP tests): fp32, its twin, float64."""
    return references(
        build,
        _tp_loss,
        steps,
        lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False),
        length=2 * 4 * 8,  # the loss sums 2 x 4 rows of 8 outputs
        lr=1e-2,
        clip=0.5,
    )


def tp_dp_steps(model, opt, mesh, refs: tolerance.References, steps: int) -> list[float]:
    """``steps`` steps of ``model`` on ``tp_references``' batch, this DP replica its half;
    ``opt.step()`` returns (skipped, gradient norm). Each step's loss (the replicas' mean) and
    gradient norm against ``refs``; returns the losses."""
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
        loss = F.mse_loss(model(x[mesh.dp_rank]), y[mesh.dp_rank])
        loss.backward()
        _, grad_norm = opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.dp_group)
        losses.append(float(mean) / mesh.dp_size)
        check([refs.loss(step, losses[-1]), norm(refs, step, grad_norm)], f"step {step + 1}: ")
    return losses


def check_overflow_skipped(out: list) -> None:
    """The ranks' (skips, unchanged, loss scale) of 4 fp16 steps with an inf injected on one
    rank at step 2: every rank alike, step 2 alone skipped (nothing moved) and the scale halved
    from 1024."""
    assert out[0] == out[1]
    skips, unchanged, scale = out[0]
    assert skips == [False, True, False, False]
    assert unchanged == [False, True, False, False]
    assert scale == 512.0


def norm(refs: tolerance.References, step: int, actual) -> tolerance.Comparison:
    """The rule on step ``step``'s gradient norm (before clipping)."""
    return tolerance.compare(
        actual,
        [refs.single.norms[step], refs.twin.norms[step]],
        refs.exact.norms[step],
        length=refs.length,
        dtype=refs.dtype,
        what=f"gradient norm of step {step + 1}",
    )


def check(comparisons: Iterable[tolerance.Comparison], where: str = "") -> None:
    """Every comparison agrees; the message names each that does not (its error and bound)."""
    bad = [str(c) for c in comparisons if not c.ok]
    if bad:
        raise AssertionError(f"{where}{len(bad)} disagree:\n" + "\n".join(bad[:12]))


def check_training(refs: tolerance.References, out: list, where: str = "") -> None:
    """Every rank's per-step losses and final parameters ``out`` (``[(losses, {name: param})]``)
    against the references; the replicated parameters bit-identical on every rank (each rank
    applies the same reduced gradients, or all-gathers the same shards)."""
    for rank, (losses, params) in enumerate(out):
        at = f"{where}rank {rank}: "
        check([refs.loss(step, v) for step, v in enumerate(losses)], at)
        assert params.keys() == refs.exact.params.keys(), at
        check([refs.param(name, p) for name, p in params.items()], at)
        for name, p in params.items():
            assert torch.equal(p, out[0][1][name]), f"{at}{name} differs from rank 0's"


def sliced(refs: tolerance.References, named: dict[str, torch.Tensor]) -> None:
    """Make ``refs`` slice each full tensor like the parameter ``named[name]`` is held here
    (``local_slice`` of its fastpar mark; as is when it has none)."""

    def local(full: torch.Tensor, name: str) -> torch.Tensor:
        p = named[name]
        layout = param_layout(p)  # fused: a gate | up block split block by block (expert TP)
        return full if layout is None else local_slice(full, p, layout.fused)

    refs.local = local
