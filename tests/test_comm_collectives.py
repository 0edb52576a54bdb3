"""Each differentiable collective: forward and backward against the math, world sizes 1, 2, 4.

Bit for bit, and for any machine and seed: the tensors are float64 multiples of 2^-10 below 2^6
(``_draw``), so every sum of up to 4 of them is exact in float64, in whatever order an
all-reduce or a reduce-scatter adds them; the other collectives only move values."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastpar import comm
from fastpar.testing import RankError, run_ranks


def _draw(*shape: int) -> torch.Tensor:
    """Normal draws rounded to multiples of 2^-10 and clamped below 2^6 in magnitude: 16
    significant bits, so sums of a few are exact in float64."""
    return (torch.randn(*shape, dtype=torch.float64) * 1024).round().clamp(-65535, 65535) / 1024


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit for bit (module docstring), with the same shape and dtype."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert torch.equal(actual, expected), f"{what}: max |diff| {(actual - expected).abs().max()}"


def _check_all(world: int) -> int:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same "full" tensors on every rank
    full = _draw(4 * world, 3, 2 * world)
    grad_full = _draw(*full.shape)
    per_rank = [_draw(2, 3, 5) for _ in range(world)]
    mine = per_rank[rank]
    checks = 0

    def run(fn, x, g):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(g)
        return y.detach(), x.grad

    # copy_to_region: identity forward, all-reduce backward
    gs = [torch.full((2, 3, 5), float(r + 1), dtype=torch.float64) for r in range(world)]
    y, gx = run(lambda x: comm.copy_to_region(x, None), mine, gs[rank])
    _same(y, mine, "copy_to_region forward")
    _same(gx, sum(gs), "copy_to_region backward (all-reduce)")
    checks += 1
    # reduce_from_region: all-reduce forward, identity backward
    y, gx = run(lambda x: comm.reduce_from_region(x, None), mine, gs[rank])
    _same(y, sum(per_rank), "reduce_from_region forward (all-reduce)")
    _same(gx, gs[rank], "reduce_from_region backward")
    checks += 1
    # scatter / gather along the last dim and along the sequence dim
    for dim in (-1, 0):
        chunks = full.chunk(world, dim)
        gchunks = grad_full.chunk(world, dim)
        y, gx = run(lambda x, d=dim: comm.scatter_to_region(x, None, dim=d), full, gchunks[rank])
        _same(y, chunks[rank], f"scatter_to_region forward, dim {dim}")
        # all-gather of every rank's chunk grad
        _same(gx, grad_full, f"scatter_to_region backward, dim {dim}")
        y, gx = run(
            lambda x, d=dim: comm.gather_from_region(x, None, dim=d), chunks[rank], grad_full
        )
        _same(y, full, f"gather_from_region forward, dim {dim}")
        _same(gx, gchunks[rank], f"gather_from_region backward, dim {dim}")
        checks += 2
    y, gx = run(lambda x: comm.scatter_to_sequence(x, None), full, grad_full.chunk(world, 0)[rank])
    _same(y, full.chunk(world, 0)[rank], "scatter_to_sequence forward")
    _same(gx, grad_full, "scatter_to_sequence backward")
    y, gx = run(lambda x: comm.gather_from_sequence(x, None), full.chunk(world, 0)[rank], grad_full)
    _same(y, full, "gather_from_sequence forward")
    _same(gx, grad_full.chunk(world, 0)[rank], "gather_from_sequence backward")
    checks += 2
    # all-gather forward / reduce-scatter backward: every rank's grad is a partial sum
    xs = [_draw(4, 3, 2) for _ in range(world)]
    partial = [_draw(4 * world, 3, 2) for _ in range(world)]
    y, gx = run(lambda x: comm.all_gather_reduce_scatter(x, None), xs[rank], partial[rank])
    _same(y, torch.cat(xs, 0), "all_gather_reduce_scatter forward")
    _same(gx, sum(partial).chunk(world, 0)[rank], "all_gather_reduce_scatter backward")
    checks += 1
    # reduce-scatter forward / all-gather backward
    y, gx = run(lambda x: comm.reduce_scatter_all_gather(x, None), partial[rank], xs[rank])
    _same(y, sum(partial).chunk(world, 0)[rank], "reduce_scatter_all_gather forward")
    _same(gx, torch.cat(xs, 0), "reduce_scatter_all_gather backward")
    checks += 1
    return checks


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives(world):
    assert run_ranks(_check_all, world, world) == [10] * world


def _subgroup() -> list:
    # two groups {0,1} and {2,3}: a collective over one must not see the other
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = dist.get_rank()
    g = groups[rank // 2]
    x = torch.tensor([float(2**rank)], requires_grad=True)
    y = comm.reduce_from_region(x, g)
    z = comm.gather_from_region(x, g, dim=0)
    return [y.item(), z.tolist()]


def test_collectives_respect_the_group():
    assert run_ranks(_subgroup, 4) == [[3.0, [1.0, 2.0]]] * 2 + [[12.0, [4.0, 8.0]]] * 2


def _indivisible():
    comm.scatter_to_region(torch.zeros(3, 5), None, dim=-1)


def test_indivisible_split_is_a_clear_error():
    with pytest.raises(
        RankError, match=r"size 5 of dim 1 \(shape \(3, 5\)\) is not divisible by the group size 2"
    ):
        run_ranks(_indivisible, 2)
