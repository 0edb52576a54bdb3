"""Helpers for parity tests: slice a full (single-process) tensor the way a parameter is sharded,
and judge a parallel result by ``fastpar.tolerance``'s rule (docs/tolerances.md):

    ref = make_ref()                     # the single-process model, fp32
    ref64 = exact_copy(ref)              # the same weights in float64: the exact math
    y, y32, y64 = par(x), ref(x), ref64(x.double())
    agree(y, y32, y64, "output", length=H)                  # error <= 4 x fp32's own + floor
    agree(p.grad, ref_w.grad, ref64_w.grad, "grad w", length=N, param=p)   # sliced like p

``TOL`` / ``assert_close`` remain for comparisons that are not a parallel result against a
single-process one (a value computed two ways on purpose with a documented error, a loss scale):
never for parity.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

from fastpar import tolerance
from fastpar.moe.layer import aux_loss_scale
from fastpar.nn.marks import param_layout
from fastpar.ops.moe_permute import moe_permute

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def local_slice(full: torch.Tensor, param: torch.Tensor, fused: int = 1) -> torch.Tensor:
    """This rank's part of ``full``, per ``param``'s mark (padded with zeros like the layer)."""
    layout = param_layout(param)
    assert layout is not None, "parameter carries no fastpar layout mark"
    if layout.kind in ("replicated", "owned"):  # owned: whole, this rank's own entry
        return full
    world, rank = dist.get_world_size(layout.group), dist.get_rank(layout.group)
    dim = layout.dim
    if fused > 1:
        return torch.cat([b.chunk(world, dim)[rank] for b in full.chunk(fused, dim)], dim)
    per = math.ceil(full.shape[dim] / world)
    pad = per * world - full.shape[dim]
    if pad:
        shape = list(full.shape)
        shape[dim] = pad
        full = torch.cat([full, full.new_zeros(shape)], dim)
    return full.narrow(dim, rank * per, per)


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (a single-process weight or gradient) as ``param`` holds it:
    ``local_slice`` per its layout mark, the whole of it for an unmarked or replicated one."""
    layout = param_layout(param)
    if layout is None or layout.kind == "replicated":
        return full
    return local_slice(full, param, layout.fused)


def same_on_every_rank(t: torch.Tensor, group, what: str) -> None:
    """``t`` is the same bits on every rank of ``group`` (a replicated gradient: one
    all-reduce's result)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    for r, other in enumerate(parts):
        torch.testing.assert_close(other, t, rtol=0, atol=0, msg=f"{what} differs on rank {r}")


def assert_close(actual, expected, what: str, dtype=torch.float32) -> None:
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **TOL[dtype])


def exact_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``module`` (same weights): the exact math of the single-process run.
    Process groups a (parallel) module holds are shared with the copy, not copied."""
    memo: dict[int, object] = {}

    def keep(value, depth: int = 0) -> None:
        if isinstance(value, dist.ProcessGroup):
            memo[id(value)] = value
        elif depth < 3 and isinstance(value, (list, tuple, set)):
            for v in value:
                keep(v, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for v in value.values():
                keep(v, depth + 1)
        elif (
            depth < 3
            and hasattr(value, "__dict__")
            and not isinstance(value, (torch.Tensor, type, torch.nn.Module))
        ):
            for v in vars(value).values():
                keep(v, depth + 1)

    for m in module.modules():
        for v in vars(m).values():
            keep(v)
    return copy.deepcopy(module, memo).double()


def agree(
    actual,
    single,
    exact,
    what: str,
    *,
    length: int,
    dtype: torch.dtype = torch.float32,
    param: torch.Tensor | None = None,
    fused: int = 1,
    slack=0.0,
) -> tolerance.Comparison:
    """``fastpar.tolerance.assert_agree``: ``actual`` (the parallel run) against ``single`` (the
    single-process run in ``dtype``, or a list of such runs) and ``exact`` (float64), both sliced
    like the sharded parameter ``param`` when given (``local_slice``); ``length``: the longest
    reduction feeding the quantity."""
    if param is not None:
        cut = lambda t: local_slice(torch.as_tensor(t), param, fused)  # noqa: E731
        single = [cut(t) for t in single] if isinstance(single, (list, tuple)) else cut(single)
        exact = cut(exact)
    return tolerance.assert_agree(
        actual, single, exact, length=length, dtype=dtype, what=what, slack=slack
    )


def moe_rank_references(ref, xs, gs) -> tuple[list, list, list]:
    """The single-process MoE ``ref`` on each EP rank's tokens ``xs[r]`` with output gradient
    ``gs[r]`` (its aux loss added): per rank (outputs, input grads, router grads). ``ref``'s
    gradients are then left holding the sum over every rank's tokens without the aux loss —
    what each expert's gradient is under EP (every rank's tokens reach every expert)."""
    outs, x_grads, router_grads = [], [], []
    for x, g in zip(xs, gs, strict=True):
        ref.zero_grad()
        xr = x.clone().requires_grad_()
        y = ref(xr)
        (y * g).sum().add(ref.aux_loss).backward()
        outs.append(y.detach())
        x_grads.append(xr.grad)
        router_grads.append(ref.router.weight.grad.clone())
    ref.zero_grad()
    with aux_loss_scale(None):  # the aux loss stays out of backward
        for x, g in zip(xs, gs, strict=True):
            (ref(x) * g).sum().backward()
    return outs, x_grads, router_grads


def same_routing(ref, ref64, xs) -> None:
    """The premise of comparing with float64: the fp32 and float64 layers route every token alike
    (the same experts chosen, the same choices dropped). A near-tie of two scores could split
    them; it fails here, by name, rather than as an error of the size of an expert's output."""
    with torch.no_grad():
        for x in xs:
            kept = []
            for m in (ref, ref64):
                t = x.reshape(-1, m.hidden_size).to(m.router.weight.dtype)
                r = m.router(t, seq_len=x.shape[-2] if x.dim() >= 3 else None)
                _, info = moe_permute(t, r.expert_ids, m.num_experts, r.capacity, r.order)
                kept.append(torch.where(info.slots >= 0, r.expert_ids, -1))
            assert torch.equal(*kept), "fp32 and float64 route differently: a near-tie"


def ep_run(moe, ref, xs, gs) -> tuple:
    """The expert-parallel ``moe`` on this rank's tokens ``xs[rank]`` (output gradient
    ``gs[rank]``, its aux loss added) beside the single-process ``ref`` and its float64 copy on
    every rank's (``moe_rank_references``), once they are shown to route alike: (output, input,
    fp32 references, float64 references, the float64 copy)."""
    rank = dist.get_rank()
    ref64 = exact_copy(ref)
    same_routing(ref, ref64, xs)
    single = moe_rank_references(ref, xs, gs)  # experts: all tokens
    exact = moe_rank_references(ref64, [x.double() for x in xs], [g.double() for g in gs])
    xp = xs[rank].clone().requires_grad_()
    y = moe(xp)
    (y * gs[rank]).sum().add(moe.aux_loss).backward()
    return y, xp, single, exact, ref64


def agree_ep(moe, ref, run: tuple, length: int, what: str = "") -> None:
    """``ep_run``'s output, input gradient and router gradient on this rank, and the gradients
    of its local experts (a slice of the single process's), by the rule."""
    rank = dist.get_rank()
    y, xp, single, exact, ref64 = run
    for name, got, i in (
        ("output", y, 0),
        ("input grad", xp.grad, 1),
        ("router grad", moe.router.weight.grad, 2),
    ):
        agree(got, single[i][rank], exact[i][rank], f"{what}{name}", length=length)
    sl = slice(rank * moe.num_local, (rank + 1) * moe.num_local)
    for name in ("w1", "b1", "w2", "b2"):
        full, full64 = getattr(ref, name).grad[sl], getattr(ref64, name).grad[sl]
        agree(getattr(moe, name).grad, full, full64, f"{what}expert grad {name}", length=length)


#: inductor's generated C++ does not build under ``ATEN_CPU_CAPABILITY=default`` (torch 2.13:
#: "'at::vec' has not been declared"), a torch limitation; the second CPU kernel path of
#: scripts/run_tests.sh skips the tests that compile with inductor
NO_INDUCTOR = pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") == "default",
    reason="inductor's C++ code does not build under ATEN_CPU_CAPABILITY=default ('at::vec' "
    "has not been declared: a torch 2.13 limitation)",
)
