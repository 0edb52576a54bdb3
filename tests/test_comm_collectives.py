"""Each differentiable collective: forward and backward against the math, world sizes 1, 2, 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastpar import comm
from fastpar.testing import RankError, run_ranks


def _check_all(world: int) -> int:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same "full" tensors on every rank
    full = torch.randn(4 * world, 3, 2 * world, dtype=torch.float64)
    grad_full = torch.randn_like(full)
    per_rank = [torch.randn(2, 3, 5, dtype=torch.float64) for _ in range(world)]
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
    torch.testing.assert_close(y, mine)
    torch.testing.assert_close(gx, sum(gs))
    checks += 1
    # reduce_from_region: all-reduce forward, identity backward
    y, gx = run(lambda x: comm.reduce_from_region(x, None), mine, gs[rank])
    torch.testing.assert_close(y, sum(per_rank))
    torch.testing.assert_close(gx, gs[rank])
    checks += 1
    # scatter / gather along the last dim and along the sequence dim
    for dim in (-1, 0):
        chunks = full.chunk(world, dim)
        gchunks = grad_full.chunk(world, dim)
        y, gx = run(lambda x, d=dim: comm.scatter_to_region(x, None, dim=d), full, gchunks[rank])
        torch.testing.assert_close(y, chunks[rank])
        torch.testing.assert_close(gx, grad_full)  # all-gather of every rank's chunk grad
        y, gx = run(
            lambda x, d=dim: comm.gather_from_region(x, None, dim=d), chunks[rank], grad_full
        )
        torch.testing.assert_close(y, full)
        torch.testing.assert_close(gx, gchunks[rank])
        checks += 2
    y, gx = run(lambda x: comm.scatter_to_sequence(x, None), full, grad_full.chunk(world, 0)[rank])
    torch.testing.assert_close(y, full.chunk(world, 0)[rank])
    y, gx = run(lambda x: comm.gather_from_sequence(x, None), full.chunk(world, 0)[rank], grad_full)
    torch.testing.assert_close(y, full)
    checks += 2
    # all-gather forward / reduce-scatter backward: every rank's grad is a partial sum
    xs = [torch.randn(4, 3, 2, dtype=torch.float64) for _ in range(world)]
    partial = [torch.randn(4 * world, 3, 2, dtype=torch.float64) for _ in range(world)]
    y, gx = run(lambda x: comm.all_gather_reduce_scatter(x, None), xs[rank], partial[rank])
    torch.testing.assert_close(y, torch.cat(xs, 0))
    torch.testing.assert_close(gx, sum(partial).chunk(world, 0)[rank])
    checks += 1
    # reduce-scatter forward / all-gather backward
    y, gx = run(lambda x: comm.reduce_scatter_all_gather(x, None), partial[rank], xs[rank])
    torch.testing.assert_close(y, sum(partial).chunk(world, 0)[rank])
    torch.testing.assert_close(gx, torch.cat(xs, 0))
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
