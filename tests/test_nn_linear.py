"""ColumnParallelLinear / RowParallelLinear against nn.Linear: init, outputs, every gradient,
sequence parallelism, and an MLP's loss over several optimizer steps, at TP = 1, 2, 4.

The initialisation is a slice of nn.Linear's (the same draws): equal bit for bit. Outputs and
gradients are computed by other kernels on other shapes (a partial product per rank, an
all-reduce of partial sums), so they are judged by ``fastpar.tolerance``'s rule against the same
math in float64 (docs/tolerances.md)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import agree, exact_copy, local_slice
from torch import nn

from fastpar.nn import ColumnParallelLinear, RowParallelLinear, param_layout
from fastpar.testing import RankError, RankTimeout, run_ranks
from fastpar.tolerance import train_references

WORLDS = [1, 2, 4]


def _cols(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's columns (last dim) of ``t``, sliced and padded like the column weight ``p``."""
    return local_slice(t.transpose(0, -1), p).transpose(0, -1)


def _init_is_bit_exact() -> None:
    # each rank's weight is a slice of the same draws as nn.Linear's: equal bit for bit
    for bias in (True, False):
        torch.manual_seed(7)
        ref = nn.Linear(123, 124, bias=bias)
        torch.manual_seed(7)
        col = ColumnParallelLinear(123, 124, bias=bias)
        assert torch.equal(col.weight, local_slice(ref.weight, col.weight))
        if bias:
            assert torch.equal(col.bias, local_slice(ref.bias, col.bias))
        torch.manual_seed(7)
        ref = nn.Linear(124, 123, bias=bias)
        torch.manual_seed(7)
        row = RowParallelLinear(124, 123, bias=bias)
        assert torch.equal(row.weight, local_slice(ref.weight, row.weight))
        if bias:
            assert torch.equal(row.bias, ref.bias)
        # and the random stream is left where nn.Linear leaves it
        after_parallel = torch.rand(3)
        torch.manual_seed(7)
        nn.Linear(124, 123, bias=bias)
        assert torch.equal(after_parallel, torch.rand(3))
    world = dist.get_world_size()
    assert param_layout(col.weight).kind == "sharded" and param_layout(col.weight).dim == 0
    assert param_layout(row.weight).dim == 1
    torch.manual_seed(0)
    row = RowParallelLinear(124, 123)
    assert param_layout(row.bias).kind == "replicated"
    assert col.weight.shape == (124 // world, 123)


@pytest.mark.parametrize("world", WORLDS)
def test_init_matches_nn_linear_bit_for_bit(world):
    run_ranks(_init_is_bit_exact, world)


def _column_parity(gather_output: bool, bias: bool, pad: bool) -> None:
    out = 123 if pad else 124
    torch.manual_seed(1)
    ref = nn.Linear(123, out, bias=bias)
    torch.manual_seed(1)
    col = ColumnParallelLinear(123, out, bias=bias, gather_output=gather_output, pad_output=pad)
    ref64 = exact_copy(ref)
    torch.manual_seed(2)
    x = torch.randn(5, 123, 123)
    gy = torch.randn(5, 123, out)
    n = 5 * 123  # the longest sum: a weight gradient over the tokens
    xr, xp, x64 = (
        x.clone().requires_grad_(),
        x.clone().requires_grad_(),
        x.double().requires_grad_(),
    )
    yr = ref(xr)
    yr.backward(gy)
    y64 = ref64(x64)
    y64.backward(gy.double())
    yp = col(xp)
    if gather_output:
        assert yp.shape == yr.shape
        agree(yp, yr, y64, "output", length=n)
        yp.backward(gy)
    else:
        # local columns of the output, padded like the weight
        w = col.weight
        agree(yp, _cols(yr, w), _cols(y64, w), "local output", length=n)
        yp.backward(_cols(gy, w))
    agree(xp.grad, xr.grad, x64.grad, "input grad", length=n)
    agree(
        col.weight.grad,
        ref.weight.grad,
        ref64.weight.grad,
        "weight grad",
        length=n,
        param=col.weight,
    )
    if bias:
        agree(col.bias.grad, ref.bias.grad, ref64.bias.grad, "bias grad", length=n, param=col.bias)


@pytest.mark.parametrize("world", WORLDS)
def test_column_parallel_parity(world):
    def cases():
        for gather in (False, True):
            for bias in (True, False):
                _column_parity(gather, bias, pad=False)
        _column_parity(True, True, pad=True)
        _column_parity(False, True, pad=True)

    run_ranks(cases, world)


def _row_parity(input_is_parallel: bool, bias: bool) -> None:
    torch.manual_seed(3)
    ref = nn.Linear(124, 123, bias=bias)
    torch.manual_seed(3)
    row = RowParallelLinear(124, 123, bias=bias, input_is_parallel=input_is_parallel)
    ref64 = exact_copy(ref)
    torch.manual_seed(4)
    x = torch.randn(5, 123, 124)
    gy = torch.randn(5, 123, 123)
    n = 5 * 123  # the longest sum: a weight gradient over the tokens
    xr, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    yr = ref(xr)
    yr.backward(gy)
    y64 = ref64(x64)
    y64.backward(gy.double())
    world, rank = dist.get_world_size(), dist.get_rank()
    xin = x.chunk(world, -1)[rank] if input_is_parallel else x
    xp = xin.clone().requires_grad_()
    yp = row(xp)
    agree(yp, yr, y64, "output", length=n)
    yp.backward(gy)

    def mine(g):  # this rank's part of the input gradient
        return g.chunk(world, -1)[rank] if input_is_parallel else g

    agree(xp.grad, mine(xr.grad), mine(x64.grad), "input grad", length=n)
    agree(
        row.weight.grad,
        ref.weight.grad,
        ref64.weight.grad,
        "weight grad",
        length=n,
        param=row.weight,
    )
    if bias:
        agree(row.bias.grad, ref.bias.grad, ref64.bias.grad, "bias grad", length=n)


@pytest.mark.parametrize("world", WORLDS)
def test_row_parallel_parity(world):
    def cases():
        for parallel_in in (True, False):
            for bias in (True, False):
                _row_parity(parallel_in, bias)

    run_ranks(cases, world)


class DenseMLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc = nn.Linear(h, f)
        self.proj = nn.Linear(f, h)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class ParallelMLP(nn.Module):
    def __init__(self, h: int, f: int, sequence_parallel: bool = False):
        super().__init__()
        self.fc = ColumnParallelLinear(h, f, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(f, h, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def _mlp_batch(step: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 3, 36, generator=g)  # [s, b, h]
    target = torch.randn(8, 3, 36, generator=g)
    return x.to(dtype), target.to(dtype)


def _mlp_loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    x, target = _mlp_batch(step, dtype)
    return F.mse_loss(model(x), target)


STEPS, LR, WD = 5, 1e-2, 1e-2


def _ok(comparison) -> None:
    assert comparison.ok, str(comparison)


def _mlp_training(sequence_parallel: bool) -> list[float]:
    """Column -> GELU -> Row against the dense MLP: the gradients and the loss of every step, and
    every parameter after 5 AdamW steps, judged by the rule against the dense MLP's fp32 run,
    its twin and its float64 run (``train_references``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    refs = train_references(
        lambda: DenseMLP(36, 64), _mlp_loss, STEPS, length=64, seed=5, lr=LR, weight_decay=WD
    )
    torch.manual_seed(5)
    par = ParallelMLP(36, 64, sequence_parallel)
    refs.local = lambda t, name: local_slice(t, par.get_parameter(name))
    opt_p = torch.optim.AdamW(par.parameters(), lr=LR, weight_decay=WD, foreach=False)
    start = {name: p.detach().clone() for name, p in par.named_parameters()}
    losses = []
    for step in range(STEPS):
        x, target = _mlp_batch(step)
        if sequence_parallel:
            xs = x.chunk(world, 0)[rank].clone().requires_grad_()
            y = par(xs)
            assert y.shape == (8 // world, 3, 36)
            # mean over the full sequence = sum of each rank's chunk mean / world
            part = F.mse_loss(y, target.chunk(world, 0)[rank], reduction="sum") / target.numel()
            loss_p = part.detach().clone()
            dist.all_reduce(loss_p)
        else:
            xs = x.clone().requires_grad_()
            part = loss_p = F.mse_loss(par(xs), target)
        opt_p.zero_grad()
        part.backward()
        for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
            _ok(refs.grad(step, name, par.get_parameter(name).grad))
        _ok(refs.loss(step, float(loss_p)))
        losses.append(float(loss_p))
        opt_p.step()
    for name, p in par.named_parameters():
        _ok(refs.param(name, p.detach()))
    # the replicated bias is the same on every rank, bit for bit: the same all-reduced gradient
    # and the same AdamW step on each
    bias = par.proj.bias.detach()
    copies = [torch.empty_like(bias) for _ in range(world)]
    dist.all_gather(copies, bias)
    assert all(torch.equal(c, bias) for c in copies), "proj.bias differs across ranks"
    moved = [n for n, p in par.named_parameters() if not torch.equal(p.detach(), start[n])]
    return losses, moved


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mlp_trains_like_dense(world, sequence_parallel):
    out = run_ranks(_mlp_training, world, sequence_parallel)
    # every rank sees the same loss, bit for bit: the one all-reduced sum (or the row layer's
    # all-reduced output) on every rank
    assert all(losses == out[0][0] for losses, _ in out)
    # and it is training: every parameter moved (each step's batch is new random noise, so the
    # last loss need not be below the first; the losses are judged against the dense MLP above)
    assert all(len(moved) == 4 for _, moved in out), out


def _sp_column_input_grad() -> None:
    """Sequence-parallel column layer: input [s/tp, b, h] chunk, its gradient is the chunk of
    the dense input gradient (reduce-scattered)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(9)
    ref = nn.Linear(12, 8)
    torch.manual_seed(9)
    col = ColumnParallelLinear(12, 8, sequence_parallel=True, gather_output=True)
    ref64 = exact_copy(ref)
    torch.manual_seed(10)
    x = torch.randn(4 * world, 2, 12)
    gy = torch.randn(4 * world, 2, 8)
    n = 8 * world  # the longest sum: a weight gradient over the tokens
    xr, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    yr = ref(xr)
    yr.backward(gy)
    y64 = ref64(x64)
    y64.backward(gy.double())
    xp = x.chunk(world, 0)[rank].clone().requires_grad_()
    y = col(xp)
    agree(y, yr, y64, "output (full sequence)", length=n)
    y.backward(gy)
    agree(
        xp.grad,
        xr.grad.chunk(world, 0)[rank],
        x64.grad.chunk(world, 0)[rank],
        "input grad chunk",
        length=n,
    )


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_column_input_grad(world):
    run_ranks(_sp_column_input_grad, world)


def _bad_inputs() -> str:
    col = ColumnParallelLinear(8, 8)
    with pytest.raises(ValueError, match=r"expects input \[\.\.\., 8\], got \(2, 7\)"):
        col(torch.zeros(2, 7))
    row = RowParallelLinear(8, 8)
    with pytest.raises(ValueError, match=r"expects input \[\.\.\., 4\] \(input_is_parallel=True\)"):
        row(torch.zeros(2, 8))
    with pytest.raises(
        ValueError, match="out_features 7 is not divisible by the tensor-parallel size 2"
    ):
        ColumnParallelLinear(8, 7)
    with pytest.raises(
        ValueError, match="in_features 7 is not divisible by the tensor-parallel size 2"
    ):
        RowParallelLinear(7, 8)
    return "ok"


def test_bad_inputs_are_clear_errors():
    assert run_ranks(_bad_inputs, 2) == ["ok", "ok"]


def test_layers_work_without_a_process_group():
    # a single process with no torch.distributed: TP = 1, equal to nn.Linear
    assert not dist.is_initialized()
    torch.manual_seed(0)
    ref = nn.Linear(5, 6)
    torch.manual_seed(0)
    col = ColumnParallelLinear(5, 6)
    x = torch.randn(2, 5)
    # the same F.linear on the same weights and shapes (no communication at TP = 1): bit for bit
    assert torch.equal(col(x), ref(x))


def _mismatch() -> None:
    # rank 1 passes a different world view: a clear error, not a hang or silent garbage
    col = ColumnParallelLinear(4, 4, gather_output=True)
    col(torch.zeros(3, 4) if dist.get_rank() == 0 else torch.zeros(2, 4))


def test_mismatched_batch_across_ranks_fails_not_hangs():
    with pytest.raises(RankError) as info:
        run_ranks(_mismatch, 2, timeout=30)
    assert not isinstance(info.value, RankTimeout), "a size mismatch should fail, not time out"
