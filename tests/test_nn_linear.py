"""ColumnParallelLinear / RowParallelLinear against nn.Linear: init, outputs, every gradient,
sequence parallelism, and an MLP's loss over several optimizer steps, at TP = 1, 2, 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import assert_close, local_slice
from torch import nn

from fastpar.nn import ColumnParallelLinear, RowParallelLinear, param_layout
from fastpar.testing import RankError, RankTimeout, run_ranks

WORLDS = [1, 2, 4]


def _init_is_bit_exact() -> None:
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
    torch.manual_seed(2)
    x = torch.randn(5, 123, 123)
    gy = torch.randn(5, 123, out)
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(gy)
    yp = col(xp)
    if gather_output:
        assert yp.shape == yr.shape
        assert_close(yp, yr, "output")
        yp.backward(gy)
    else:
        # local columns of the output, padded like the weight
        assert_close(yp, local_slice(yr.transpose(0, -1), col.weight).transpose(0, -1), "output")
        yp.backward(local_slice(gy.transpose(0, -1), col.weight).transpose(0, -1))
    assert_close(xp.grad, xr.grad, "input grad")
    assert_close(col.weight.grad, local_slice(ref.weight.grad, col.weight), "weight grad")
    if bias:
        assert_close(col.bias.grad, local_slice(ref.bias.grad, col.bias), "bias grad")


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
    torch.manual_seed(4)
    x = torch.randn(5, 123, 124)
    gy = torch.randn(5, 123, 123)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(gy)
    world, rank = dist.get_world_size(), dist.get_rank()
    xin = x.chunk(world, -1)[rank] if input_is_parallel else x
    xp = xin.clone().requires_grad_()
    yp = row(xp)
    assert_close(yp, yr, "output")
    yp.backward(gy)
    gx = xr.grad.chunk(world, -1)[rank] if input_is_parallel else xr.grad
    assert_close(xp.grad, gx, "input grad")
    assert_close(row.weight.grad, local_slice(ref.weight.grad, row.weight), "weight grad")
    if bias:
        assert_close(row.bias.grad, ref.bias.grad, "bias grad")


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


def _mlp_training(sequence_parallel: bool) -> list[float]:
    """Column -> GELU -> Row against the dense MLP: outputs, grads, and 5 AdamW steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(5)
    ref = DenseMLP(36, 64)
    torch.manual_seed(5)
    par = ParallelMLP(36, 64, sequence_parallel)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2)
    losses = []
    for step in range(5):
        torch.manual_seed(100 + step)
        x = torch.randn(8, 3, 36)  # [s, b, h]
        target = torch.randn(8, 3, 36)
        loss_r = F.mse_loss(ref(x), target)
        opt_r.zero_grad()
        loss_r.backward()
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
        if step == 0:
            for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
                p = par.get_parameter(name)
                assert_close(p.grad, local_slice(ref.get_parameter(name).grad, p), f"grad {name}")
        assert_close(loss_p, loss_r.detach(), f"loss at step {step}")
        losses.append(float(loss_p))
        opt_r.step()
        opt_p.step()
    for name, p in par.named_parameters():
        assert_close(
            p.detach(), local_slice(ref.get_parameter(name).detach(), p), f"{name} after 5 steps"
        )
    return losses


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mlp_trains_like_dense(world, sequence_parallel):
    losses = run_ranks(_mlp_training, world, sequence_parallel)
    assert all(lst == losses[0] for lst in losses)  # every rank sees the same loss
    assert losses[0][-1] < losses[0][0]  # and it is training


def _sp_column_input_grad() -> None:
    """Sequence-parallel column layer: input [s/tp, b, h] chunk, its gradient is the chunk of
    the dense input gradient (reduce-scattered)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(9)
    ref = nn.Linear(12, 8)
    torch.manual_seed(9)
    col = ColumnParallelLinear(12, 8, sequence_parallel=True, gather_output=True)
    torch.manual_seed(10)
    x = torch.randn(4 * world, 2, 12)
    gy = torch.randn(4 * world, 2, 8)
    xr = x.clone().requires_grad_()
    ref(xr).backward(gy)
    xp = x.chunk(world, 0)[rank].clone().requires_grad_()
    y = col(xp)
    assert_close(y, ref(x), "output (full sequence)")
    y.backward(gy)
    assert_close(xp.grad, xr.grad.chunk(world, 0)[rank], "input grad chunk")


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
    assert torch.equal(col(x), ref(x))


def _mismatch() -> None:
    # rank 1 passes a different world view: a clear error, not a hang or silent garbage
    col = ColumnParallelLinear(4, 4, gather_output=True)
    col(torch.zeros(3, 4) if dist.get_rank() == 0 else torch.zeros(2, 4))


def test_mismatched_batch_across_ranks_fails_not_hangs():
    with pytest.raises(RankError) as info:
        run_ranks(_mismatch, 2, timeout=30)
    assert not isinstance(info.value, RankTimeout), "a size mismatch should fail, not time out"
