"""DDP and ZeRO-1/2 training equal single-process training on the concatenated batch.

"Equal" is ``fastpar.tolerance``'s rule (docs/tolerances.md): a data-parallel run sums its
gradients in another order (per-replica means, averaged by an all-reduce; micro-batches
accumulated), so it is not bit-identical to the single process. Each step's loss and every
parameter afterwards are judged against the same training in float64: an error at most 4 x the
larger of the fp32 single-process run's and its twin's (weights one rounding away), plus a
floor, plus what AdamW makes of the gradients' bounds (``adam_slack``). ``references`` and
``check`` (tests/_training.py) are shared with the other data-parallel and pipeline tests."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _training import (
    check,
    check_overflow_skipped,
    check_training,
    global_batch,
    mse_loss,
    references,
    sliced,
    tp_dp_steps,
    tp_references,
)
from torch import nn

from fastpar import tolerance
from fastpar.amp import DynamicLossScaler
from fastpar.nn import ColumnParallelLinear, RowParallelLinear
from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
from fastpar.parallel import DistributedDataParallel
from fastpar.testing import RankError, run_ranks
from fastpar.zero import ZeroOptimizer

STEPS = 4


def _model() -> nn.Module:
    # odd sizes: flat buffers need padding to a multiple of the DP size
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5))


def _global_batch(step: int, micro: int, world: int):
    return global_batch(step, micro, world, 7, 5)  # [micro, rank, batch, features]


def _length(micro: int, world: int) -> int:
    """The longest reduction: the loss sums micro x world x 3 rows of 5 outputs."""
    return micro * world * 3 * 5


def _reference(steps: int, micro: int, world: int, opt_name: str, lr: float = 0.05):
    return references(
        _model,
        mse_loss(micro, world, 7, 5),
        steps,
        lambda model: _make_opt(opt_name, model.parameters(), lr, reference=True),
        length=_length(micro, world),
        lr=lr * 0.2,
    )


def _make_opt(name: str, params, lr: float, reference: bool = False):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if reference:  # every AdamW's oracle is torch's single-tensor AdamW (float64 too)
        return torch.optim.AdamW(params, lr=lr * 0.2, weight_decay=0.01, foreach=False)
    if name == "fastpar-adamw":  # fastpar's fused AdamW
        return FusedAdamW(params, lr=lr * 0.2, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=lr * 0.2, weight_decay=0.01, fused=name == "adamw-fused")


def _train(kind: str, micro: int, bucket_mb: float, opt_name: str) -> tuple[list, dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank)  # different init on every rank: wrapping must broadcast rank 0's
    if rank == 0:
        torch.manual_seed(0)
    model = _model()
    if kind == "ddp":
        wrapped = DistributedDataParallel(model, bucket_size_mb=bucket_mb)
        opt = _make_opt(opt_name, model.parameters(), 0.05)
    else:
        wrapped = model
        stage = 1 if kind == "zero1" else 2
        opt = ZeroOptimizer(
            _make_opt(opt_name, model.parameters(), 0.05), stage=stage, bucket_size_mb=bucket_mb
        )
    losses = []
    for step in range(STEPS):
        x, y = _global_batch(step, micro, world)
        total = torch.zeros(())
        for m in range(micro):
            owner = wrapped if kind == "ddp" else opt
            with owner.no_sync() if m < micro - 1 else contextlib.nullcontext():
                loss = F.mse_loss(wrapped(x[m, rank]), y[m, rank]) / micro
                loss.backward()
            total += loss.detach()
        opt.step()
        if kind == "ddp":
            wrapped.zero_grad()
        else:
            opt.zero_grad()
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = [
    # kind, world, micro, bucket MB, optimizer
    ("ddp", 2, 1, 25.0, "sgd"),
    ("ddp", 4, 2, 1e-4, "adamw"),  # tiny buckets: one parameter each; gradient accumulation
    ("zero1", 2, 1, 25.0, "adamw"),
    ("zero1", 2, 2, 25.0, "sgd"),
    ("zero1", 4, 2, 1e-4, "adamw-fused"),
    ("zero2", 2, 2, 25.0, "adamw-fused"),
    ("zero2", 4, 1, 1e-4, "sgd"),
    ("zero2", 4, 2, 2e-4, "adamw"),
    ("zero1", 2, 1, 25.0, "fastpar-adamw"),
    ("zero2", 4, 2, 1e-4, "fastpar-adamw"),
]


@pytest.mark.parametrize("kind,world,micro,bucket_mb,opt_name", CASES)
def test_training_equals_single_process(kind, world, micro, bucket_mb, opt_name):
    refs = _reference(STEPS, micro, world, opt_name)
    check_training(refs, run_ranks(_train, world, kind, micro, bucket_mb, opt_name))


def _fp16_overflow(kind: str) -> tuple:
    """fp16 + dynamic loss scaling + an inf injected on one rank: everyone skips that step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = _model().half()
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=1)
    if kind == "ddp":
        model = DistributedDataParallel(model, reduce_dtype=torch.float32)
        opt = MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), scaler=scaler
        )
    else:
        opt = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
            stage=int(kind[-1]),
            scaler=scaler,
        )
    skips, snapshots = [], []
    for step in range(4):
        x, y = _global_batch(step, 1, world)
        loss = F.mse_loss(model(x[0, rank].half()).float(), y[0, rank])
        before = [p.detach().clone() for p in model.parameters()]
        opt.scale_loss(loss).backward()
        if step == 1 and rank == world - 1:
            # corrupt this rank's gradient after the reduction: the step must still be skipped
            if kind == "ddp":
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            else:
                opt.shard_grad[0].view(-1)[0] = float("inf")
        skipped, _ = opt.step()
        opt.zero_grad()
        skips.append(bool(skipped))
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        snapshots.append(same)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    return skips, snapshots, float(opt.scaler.scale)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_fp16_overflow_on_one_rank_skips_everywhere(kind):
    check_overflow_skipped(run_ranks(_fp16_overflow, 2, kind))


def _tp_dense() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _tp_dp(kind: str, fused: bool, refs: tolerance.References) -> list[float]:
    """TP = 2 inside, DP = 2 across: equals the dense model on the concatenated batch (every
    step's loss averaged over the replicas, every TP-local parameter after the steps)."""
    mesh = make_mesh(tp=2, dp=2)
    torch.manual_seed(0)
    dense = _tp_dense()
    par = nn.Sequential(
        ColumnParallelLinear.from_dense(dense[0], mesh=mesh),
        nn.GELU(),
        RowParallelLinear.from_dense(dense[2], mesh=mesh),
    )
    inner_cls = FusedAdamW if fused else torch.optim.AdamW
    if kind == "ddp":
        model = DistributedDataParallel(par, mesh=mesh, bucket_size_mb=1e-4)
        opt = MixedPrecisionOptimizer(
            inner_cls(par.parameters(), lr=1e-2), mesh=mesh, max_grad_norm=0.5
        )
    else:
        model = par
        opt = ZeroOptimizer(
            inner_cls(par.parameters(), lr=1e-2),
            stage=int(kind[-1]),
            mesh=mesh,
            max_grad_norm=0.5,
        )
    losses = tp_dp_steps(model, opt, mesh, refs, STEPS)
    named = dict(par.named_parameters())
    sliced(refs, named)
    check([refs.param(name, p.detach()) for name, p in named.items()], f"after {STEPS} steps: ")
    return losses


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_tp2_dp2(kind, fused):
    """with fused=True the clipping coefficient is folded into FusedAdamW's pass"""
    run_ranks(_tp_dp, 4, kind, fused, tp_references(_tp_dense, STEPS))


def _unused() -> None:
    model = DistributedDataParallel(nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)}))
    model.module["a"](torch.randn(2, 3)).sum().backward()


def test_unused_parameters_are_reported():
    with pytest.raises(
        RankError,
        match=r"2 parameter\(s\) received no gradient in this backward: \['b.bias', 'b.weight'\]",
    ):
        run_ranks(_unused, 2)


def _unused_ok() -> list:
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)}), find_unused_parameters=True
    )
    x = torch.full((2, 3), float(dist.get_rank() + 1))
    model.module["a"](x).sum().backward()
    return [model.module["b"].weight.grad.abs().sum().item(), model.module["a"].bias.grad.tolist()]


def test_find_unused_parameters():
    out = run_ranks(_unused_ok, 2)
    assert out[0] == out[1]
    assert out[0][0] == 0.0
    assert out[0][1] == [2.0, 2.0, 2.0]  # d(sum)/d(bias) = batch size 2 on both ranks


def _zero_resume(stage: int) -> bool:
    """Save the sharded state after 2 steps, continue 2 steps; a fresh optimizer loading the
    state continues bit-identically."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def build():
        torch.manual_seed(0)
        model = _model()
        opt = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            stage=stage,
            bucket_size_mb=2e-4,
            scaler=DynamicLossScaler(initial_scale=64.0),
        )
        return model, opt

    def run(model, opt, steps):
        for step in steps:
            x, y = _global_batch(step, 1, world)
            opt.scale_loss(F.mse_loss(model(x[0, rank]), y[0, rank])).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    run(model, opt, range(2))
    state = copy.deepcopy(opt.state_dict())
    run(model, opt, range(2, 4))
    model2, opt2 = build()
    opt2.load_state_dict(state)
    run(model2, opt2, range(2, 4))
    return all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_state_dict_resumes_bit_identically(stage):
    assert run_ranks(_zero_resume, 2, stage) == [True, True]


def _zero_wrong_layout() -> None:
    torch.manual_seed(0)
    opt = ZeroOptimizer(torch.optim.AdamW(_model().parameters()), stage=1)
    state = opt.state_dict()
    state["dp_rank"] = 1 - state["dp_rank"]
    opt.load_state_dict(state)


def test_zero_state_dict_refuses_another_layout():
    with pytest.raises(RankError, match="loads only into the same layout"):
        run_ranks(_zero_wrong_layout, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        ZeroOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), stage=3)
    with pytest.raises(ValueError, match="bucket_size_mb must be positive"):
        DistributedDataParallel(_model(), bucket_size_mb=0)


def _zero1_two_reductions() -> None:
    model = _model()
    _opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=1)  # its hooks reduce
    x = torch.randn(3, 7)
    model(x).sum().backward()
    model(x).sum().backward()  # reduces again without zero_grad: its shard would be double-counted


def test_zero1_refuses_a_second_reduction_before_zero_grad():
    with pytest.raises(RankError, match=r"accumulate micro-batches inside opt\.no_sync\(\)"):
        run_ranks(_zero1_two_reductions, 2)


def _unchecked(stage: int) -> tuple[list, dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = _model()
    opt = ZeroOptimizer(
        _make_opt("sgd", model.parameters(), 0.05), stage=stage, check_gradients=False
    )
    losses = []
    for step in range(STEPS):
        x, y = _global_batch(step, 1, world)
        loss = F.mse_loss(model(x[0, rank]), y[0, rank])
        loss.backward()
        _, grad_norm = opt.step()
        assert torch.isnan(grad_norm)  # not computed
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_without_gradient_checks_trains_the_same(stage):
    check_training(_reference(STEPS, 1, 2, "sgd"), run_ranks(_unchecked, 2, stage))
    with pytest.raises(
        ValueError, match="check_gradients=False needs scaler=None and max_grad_norm=None"
    ):
        ZeroOptimizer(
            torch.optim.SGD(_model().parameters(), lr=0.1), max_grad_norm=1.0, check_gradients=False
        )
