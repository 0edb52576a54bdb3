"""parallelize's check runs each distinct block of a repeated stack once (fastpar.nn.check:
``distinct_blocks``, ``only``): the copies of a block do not run during the check, a block
that differs from the first in anything that may change what it computes (a plain attribute,
a function, a buffer's values, its plan) is checked itself, and a model that cannot run on the
first of each kind alone is checked whole. Its dense runs: the float64 one on the model itself
(put back bit for bit), the fp32 gradients and the twin only where they can change the verdict."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _mesh import make_mesh
from torch import nn

from fastpar import parallelize, tolerance
from fastpar.nn import blocks as _blocks
from fastpar.nn import check as _check
from fastpar.nn import exact
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
    assert _blocks.distinct_blocks(model, {}) == {"blocks": dict.fromkeys("01234", "0")}
    model.blocks[2].up.bias.data[0] += 1  # parameter values do not make a kind: checked alike
    model.blocks[3].register_buffer("table", torch.zeros(2))
    model.blocks[4].register_buffer("table", torch.ones(2))  # same shape, other values
    model.blocks[1].act = torch.tanh  # a function kept as an attribute
    kinds = _blocks.distinct_blocks(model, {})["blocks"]
    assert kinds == {"0": "0", "1": "1", "2": "0", "3": "3", "4": "4"}
    # a planned style on one block makes it its own kind; two blocks: both kept, none left out
    plan = {"blocks.2.up": ("column", {})}
    assert _blocks.distinct_blocks(Stack(n=3), plan) == {"blocks": {"0": "0", "1": "0", "2": "2"}}
    assert _blocks.distinct_blocks(Stack(n=2, mixed=(1,)), {}) == {}
    # a list of one, or none: nothing to leave out
    assert _blocks.distinct_blocks(nn.Sequential(nn.Linear(2, 2)), {}) == {}


def test_the_dense_runs_equal_copies_and_leave_the_model_as_it_was():
    model, x = Stack(n=2), ((_x(),), {})
    before = {n: t.clone() for n, t in model.state_dict().items()}
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    ref = _check.dense_runs(model, x, backward=True)
    try:
        after = model.state_dict()
        assert all(
            torch.equal(after[n], t) and after[n].dtype == t.dtype for n, t in before.items()
        )
        assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())
        # the float64 run (in place, promoted) is a float64 copy's, bit for bit
        out64, grads64 = _check._run(copy.deepcopy(model).double(), ((_x().double(),), {}), True)
        assert torch.equal(ref.exact, out64) and ref.grads[-1].keys() == grads64.keys()
        assert all(torch.equal(ref.grads[-1][n], g) for n, g in grads64.items())
        # the float64 run alone; the fp32 output and gradients when asked, once: a copy's
        assert len(ref.out) == 1 and not ref.single and len(ref.grads) == 1
        out32, grads32 = _check._run(copy.deepcopy(model), x, True)
        assert ref.add_grads() and not ref.add_grads() and len(ref.grads) == 2
        assert len(ref.single) == 1 and torch.equal(ref.out[0], out32)
        assert ref.grads[0].keys() == grads32.keys()
        assert all(torch.equal(ref.grads[0][n], g) for n, g in grads32.items())
        # the twin runs when asked, once, and is tolerance.nudge's twin of a copy
        twin = copy.deepcopy(model)
        tolerance.nudge(twin)
        out_t, grads_t = _check._run(twin, x, True)
        assert ref.add_twin() and not ref.add_twin() and len(ref.single) == 2
        assert torch.equal(ref.out[1], out_t) and not torch.equal(out_t, ref.out[0])
        assert all(torch.equal(ref.grads[1][n], g) for n, g in grads_t.items())
        assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())
    finally:
        _check.forget_weights()


def _later_runs(mixed) -> tuple[int, int]:
    """parallelize on a Stack (``mixed``: its blocks that are not exact once split); returns how
    many times the check ran the fp32 gradients and the twin, negative after a refusal."""
    runs = {"add_grads": 0, "add_twin": 0}
    saved = {name: getattr(_check.Dense, name) for name in runs}

    def counted(name):
        def run(self):
            made = saved[name](self)
            runs[name] += made
            return made

        return run

    for name in runs:
        setattr(_check.Dense, name, counted(name))
    try:
        parallelize(Stack(mixed=mixed), PLAN, make_mesh(tp=2), example_inputs=_x())
        sign = 1
    except ValueError:
        sign = -1
    finally:
        for name, f in saved.items():
            setattr(_check.Dense, name, f)
    return sign * runs["add_grads"], sign * runs["add_twin"]


def test_the_fp32_gradients_and_the_twin_run_only_where_they_can_change_the_verdict():
    # exact: every gradient within the floor alone, no fp32 backward, no twin
    assert run_ranks(_later_runs, 2, ()) == [(0, 0), (0, 0)]
    # over the floor and over the fp32 run's bound: both made (once), then refused
    assert run_ranks(_later_runs, 2, (0,)) == [(-1, -1), (-1, -1)]


def _spread(offset: float) -> tuple[float, float]:
    """A replicated parameter whose gradient is the dense one +offset x its bound on TP rank 0
    and -offset x it on rank 1: (its ratio to its bound, its spread across the ranks over the
    bound), as ``_judge`` reduces them."""
    mesh = make_mesh(tp=2)
    exact = torch.linspace(1, 2, 4, dtype=torch.float64)
    single = exact.float()
    bound = tolerance.compare(single, [single], exact, length=4).bound
    p = nn.Parameter(single.clone())
    sign = 1 if mesh.tp_rank == 0 else -1
    p.grad = (exact + sign * offset * bound).float()
    out = torch.zeros(2, dtype=torch.float64)
    ref = _check.Dense(out=[out.float(), out], grads=[{"w": single}, {"w": exact}], length=4)
    ref.backward = True
    got = out.float().requires_grad_()  # an output with a graph: its gradients are judged
    verdict = _check._judge(got.detach(), got, {"w": p}, ref, mesh.tp_group, 2, set())
    return verdict.ratios["w"], verdict.spread["w"]


def test_a_replicated_gradient_that_differs_across_the_tp_ranks_is_refused():
    (ratio, spread), other = run_ranks(_spread, 2, 0.8)
    assert other == (ratio, spread)  # every rank judges alike
    assert 0.6 < ratio < 1 and 1.4 < spread < 1.8  # within its bound on each rank, 1.6 apart
    assert run_ranks(_spread, 2, 0.0)[0][1] == 0.0


class Lookup(nn.Module):
    """A table (padding row 3) and a head; ``tied``: the head is the table; ``direct``: the
    table read again outside its own lookup."""

    def __init__(self, tied: bool = False, direct: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(12, D, padding_idx=3), nn.Linear(D, 12, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.direct = direct

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        if self.direct:  # fp32 rows into a float64 sum: promoted silently, no error
            h = h + self.emb.weight[ids]
        return self.head(h)


_IDS = torch.tensor([[3, 5, 5, 7], [11, 0, 5, 3]])  # repeats, the padding row, both ends


@pytest.mark.parametrize(("tied", "direct", "rows"), [(0, 0, 1), (1, 0, 0), (0, 1, 0)])
def test_the_float64_run_reads_only_the_rows_it_looks_up_and_equals_a_promoted_copy(
    tied, direct, rows
):
    model = Lookup(bool(tied), bool(direct))
    assert list(exact.compact_tables(model)) == ([] if tied else ["emb.weight"])
    ref = _check.dense_runs(model, ((_IDS,), {}), backward=True)
    try:
        out64, grads64 = _check._run(copy.deepcopy(model).double(), ((_IDS.clone(),), {}), True)
        got = ref.grads[-1]
        # a table of its own read by its lookup alone: its rows; read elsewhere too, or tied to
        # the head: promoted whole (the second try)
        assert isinstance(got["emb.weight"], exact.Rows) == bool(rows)
        assert torch.equal(ref.exact, out64) and got.keys() == grads64.keys()
        named = dict(model.named_parameters(remove_duplicate=False))
        for n, g in grads64.items():  # bit for bit, dense
            assert torch.equal(_check._local(got[n], named[n]), g), n
        assert model.emb.weight.dtype == torch.float32 and "forward" not in vars(model.emb)
    finally:
        _check.forget_weights()


class _RollGrad(torch.autograd.Function):
    """Identity forward; backward hands each token's gradient to the next token (its row)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.roll(1, dims=-2)


def _vocab_parallel(plant: bool) -> str:
    """parallelize a Lookup with its table split over the vocabulary (``plant``: the parallel
    table's gradient rows misattributed, its output exact); returns "" or the refusal."""
    from fastpar.nn.embedding import VocabParallelEmbedding

    forward = VocabParallelEmbedding.forward
    if plant:
        VocabParallelEmbedding.forward = lambda self, ids: _RollGrad.apply(forward(self, ids))
    try:
        parallelize(Lookup(), {"emb": "vocab"}, make_mesh(tp=2), example_inputs=_IDS)
        return ""
    except ValueError as exc:
        return str(exc)
    finally:
        VocabParallelEmbedding.forward = forward


def test_a_vocab_parallel_gradient_fault_is_caught_against_the_looked_up_rows():
    assert run_ranks(_vocab_parallel, 2, False) == ["", ""]
    refused = run_ranks(_vocab_parallel, 2, True)
    assert all("emb.weight" in r and "DISAGREE" in r for r in refused), refused[0]


class _ScalarOfLinear(nn.Module):
    """An unplanned linear layer's output indexed down to one number (a 0-dim view of it)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return y * y[0, 0]


@pytest.mark.parametrize("grad", [False, True])
def test_the_probe_follows_a_scalar_sliced_off_a_linear_output(grad):
    from fastpar.nn.probe import probe

    model = _ScalarOfLinear()
    watched = {id(p): n for n, p in model.named_parameters()}
    report, out = probe(model, (torch.randn(2, 4),), {}, {}, watched, grad=grad)
    assert out.shape == (2, 4) and out.requires_grad == grad
    assert report.uses == {"a.weight": {"full"}, "a.bias": {"full"}}
