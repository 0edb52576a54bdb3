"""parallelize's check runs each distinct block of a repeated stack once (fastpar.nn.check:
``distinct_blocks``, ``only``): the copies of a block do not run during the check, a block
that differs from the first in anything that may change what it computes (a plain attribute,
a function, a buffer's values, its plan) is checked itself, and a model that cannot run on the
first of each kind alone is checked whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _mesh import make_mesh
from torch import nn

from fastpar import parallelize
from fastpar.nn import check as _check
from fastpar.testing import RankError, run_ranks

D, F_ = 8, 16
PLAN = {"blocks.*.up": "column", "blocks.*.down": "row"}


class Block(nn.Module):
    runs = 0  # forward calls of the copies (index > 0), class-wide

    def __init__(self, index: int, mix: bool = False):
        super().__init__()
        self.index, self.mix = index, mix  # index numbers the blocks: not their kind
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, F_), nn.Linear(F_, D)

    def forward(self, x):
        if self.index > 0:
            Block.runs += 1
        h = F.gelu(self.up(self.norm(x)))
        if self.mix:  # a mean over the features a column split divides: not exact once split
            h = h - h.mean(-1, keepdim=True)
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, n: int = 4, mixed=(), by_number: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(i, mix=i in mixed) for i in range(n))
        self.by_number = by_number

    def forward(self, x):
        if self.by_number:  # indexes the list by number: cannot run on the first block alone
            for i in range(4):
                x = self.blocks[i](x)
            return x
        for block in self.blocks:
            x = block(x)
        return x


def _x():
    return torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))


def _run(mixed=(), by_number=False) -> tuple[int, int, float]:
    """(copy forwards during parallelize, during one forward after it, max |parallel - dense|)."""
    mesh = make_mesh(tp=2)
    dense, model = Stack(mixed=mixed, by_number=by_number), Stack(mixed=mixed, by_number=by_number)
    Block.runs = 0
    parallelize(model, PLAN, mesh, example_inputs=_x())
    during = Block.runs
    Block.runs = 0
    out = model(_x())
    return during, Block.runs, float((out - dense(_x())).abs().max())


def test_copies_of_a_block_do_not_run_during_the_check():
    during, after, err = run_ranks(_run, 2)[0]
    assert during == 0  # the probe, the three dense runs and the parallel run: block 0 only
    assert after == 3 and err < 1e-5  # and the model is whole and exact after it


def test_a_block_that_differs_only_by_an_attribute_is_checked_and_refused():
    with pytest.raises(RankError, match="parallelize: on the probe input the parallel model"):
        run_ranks(_run, 2, (3,))  # block 3 alone takes the mean over the split features


def test_a_model_that_cannot_run_on_the_first_blocks_is_checked_whole():
    during, after, err = run_ranks(_run, 2, (), True)[0]
    assert during > 0 and after == 3 and err < 1e-5  # the copies ran: the whole model checked


def test_distinct_blocks_tells_kinds_apart():
    model = Stack(n=5)
    assert _check.distinct_blocks(model, {}) == {"blocks": dict.fromkeys("01234", "0")}
    model.blocks[2].up.bias.data[0] += 1  # parameter values do not make a kind: checked alike
    model.blocks[3].register_buffer("table", torch.zeros(2))
    model.blocks[4].register_buffer("table", torch.ones(2))  # same shape, other values
    model.blocks[1].act = torch.tanh  # a function kept as an attribute
    kinds = _check.distinct_blocks(model, {})["blocks"]
    assert kinds == {"0": "0", "1": "1", "2": "0", "3": "3", "4": "4"}
    # a planned style on one block makes it its own kind; two blocks: both kept, none left out
    plan = {"blocks.2.up": ("column", {})}
    assert _check.distinct_blocks(Stack(n=3), plan) == {"blocks": {"0": "0", "1": "0", "2": "2"}}
    assert _check.distinct_blocks(Stack(n=2, mixed=(1,)), {}) == {}
    # a list of one, or none: nothing to leave out
    assert _check.distinct_blocks(nn.Sequential(nn.Linear(2, 2)), {}) == {}
