"""The extension's all-to-all under ``torch.compile`` and its in-flight bookkeeping.

* ``all_to_all_start(x, ...) -> ticket`` / ``all_to_all_wait(ticket, x, out_splits) -> out``
  (torch's functional collectives pattern, no output aliasing an input; the aliasing check runs
  as an error, tests/conftest.py): a compiled start + wait over 2 gloo ranks equals eager, in one graph
  (``fullgraph=True``, counted with dynamo's compile counter), the wait is in the graph, and
  nothing stays registered afterwards. A start + wait whose results go unused survives AOT
  autograd's dead-code elimination (the ops are marked side-effectful: eager issues them).
* A ticket dropped without a wait releases its registry entry when it is garbage collected
  (the transfer still completes; later collectives on the group are unaffected); waiting twice
  returns the same rows at once; waiting a tensor that is not a ticket, or with another input's
  shape, is a clear error.
* The overlapped MoE layer (``overlap_chunks=2``, capacity mode, the extension transport)
  compiled equals eager: output and every gradient.

The aot_eager backend (dynamo + AOT autograd + the ops' fake implementations) keeps the compile
short on two cores.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from _mesh import make_mesh
from _parity import exact_copy
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

from fastpar import tolerance
from fastpar.moe import MoE, overlap
from fastpar.testing import run_ranks

pytestmark = pytest.mark.skipif(
    not overlap._extension_ops(), reason="fastpar._C is not built here (no compiler at install)"
)


def _pending() -> int:
    import fastpar._C

    return fastpar._C.pending_count()


def _compiled_start_wait() -> dict:
    overlap._extension_ops()
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    name = dist.distributed_c10d._get_default_group().group_name
    in_splits = [1 + rank + j for j in range(world)]  # uneven: rank r sends r + 1 + j rows to j
    out_splits = [1 + s + rank for s in range(world)]

    def f(x):
        sent = x * 2.0
        ticket = torch.ops.fastpar.all_to_all_start(sent, out_splits, in_splits, name)
        local = x.sum()  # compute while the transfer is in flight
        out = torch.ops.fastpar.all_to_all_wait(ticket, sent, out_splits)
        return out + local

    def unused(x):  # eager issues the collective: a traced graph must keep it
        ticket = torch.ops.fastpar.all_to_all_start(x, out_splits, in_splits, name)
        torch.ops.fastpar.all_to_all_wait(ticket, x, out_splits)
        return x * 2.0

    x = torch.randn(sum(in_splits), 3, generator=torch.Generator().manual_seed(rank))
    kept_ops = []  # the forward graph after AOT autograd, whose dead-code pass drops pure ops

    def forward_graph(gm, inputs):
        kept_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(unused, backend=aot_autograd(fw_compiler=forward_graph), fullgraph=True)(x)
    want = f(x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    got = [compiled(x), compiled(x + 1.0)]
    graph = counter.graphs[0]
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    return {
        "equal": torch.equal(got[0], want) and torch.equal(got[1], f(x + 1.0)),
        "frames": counter.frame_count,
        "ops": [t for t in targets if "fastpar" in t],
        "kept": [t for t in kept_ops if "fastpar" in t],
        "pending": _pending(),
    }


def test_compiled_start_and_wait_equal_eager_in_one_graph():
    for out in run_ranks(_compiled_start_wait, 2):
        assert out["equal"]
        assert out["frames"] == 1  # one graph, no break
        assert any("all_to_all_start" in t for t in out["ops"]), out["ops"]
        assert any("all_to_all_wait" in t for t in out["ops"]), out["ops"]
        assert len(out["kept"]) == 2, out["kept"]  # unused results: not dropped as dead code
        assert out["pending"] == 0


def _dropped_tickets_do_not_leak() -> dict:
    overlap._extension_ops()
    name = dist.distributed_c10d._get_default_group().group_name
    before = _pending()
    ones = torch.ones(4, 2)
    tickets = [torch.ops.fastpar.all_to_all_start(ones, [], [], name) for _ in range(5)]
    started = _pending()
    view = tickets[0][0:]  # a view keeps its storage, and so its entry, alive
    del tickets
    gc.collect()
    kept = _pending()
    del view
    gc.collect()
    after = _pending()
    # the dropped transfers completed on their own: the group still works, results are right
    x = torch.full((4, 2), float(dist.get_rank()))
    ticket = torch.ops.fastpar.all_to_all_start(x, [], [], name)
    out = torch.ops.fastpar.all_to_all_wait(ticket, x, [])
    again = torch.ops.fastpar.all_to_all_wait(ticket, x, [])  # nothing in flight: at once
    errors = []
    for args in ((torch.zeros(1, dtype=torch.uint8), x, []), (ticket, x[:, :1], [])):
        try:
            torch.ops.fastpar.all_to_all_wait(*args)
        except RuntimeError as exc:
            errors.append(str(exc))
    return {
        "counts": [before, started, kept, after, _pending()],
        "rows": out[:, 0].tolist(),
        "same": again.data_ptr() == out.data_ptr(),
        "errors": errors,
    }


def test_a_ticket_dropped_without_a_wait_releases_its_entry():
    for out in run_ranks(_dropped_tickets_do_not_leak, 2):
        assert out["counts"] == [0, 5, 1, 0, 0]
        assert out["rows"] == [0.0, 0.0, 1.0, 1.0]
        assert out["same"]
        assert len(out["errors"]) == 2
        assert "ticket was not returned by all_to_all_start" in out["errors"][0]
        assert "are not those this ticket's all_to_all_start was given" in out["errors"][1]


def _moe_compiled(capacity_factor, trace_autograd_ops: bool) -> dict:
    overlap._extension_ops()
    torch._dynamo.reset()
    rank = dist.get_rank()
    mesh = make_mesh(ep="world")
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(rank))
    x[:6] += 2.0  # skewed routing: drops in capacity mode, uneven segments in dropless
    g = torch.randn(12, 16, generator=torch.Generator().manual_seed(10 + rank))
    counter = CompileCounterWithBackend("aot_eager")
    patch = torch._dynamo.config.patch(trace_autograd_ops=trace_autograd_ops)
    with overlap.set_transport("extension"), patch:
        torch.manual_seed(0)
        moe = MoE(16, 24, 4, top_k=2, capacity_factor=capacity_factor, overlap_chunks=2, mesh=mesh)
        moe.aux_loss_scale = 0.0
        moe64 = exact_copy(moe)  # the same layer in float64: the exact math
        results = []
        for f, m, dt in (
            (moe, moe, torch.float32),
            (moe64, moe64, torch.float64),
            (torch.compile(moe, backend=counter), moe, torch.float32),
        ):
            m.zero_grad(set_to_none=True)
            xi = x.clone().to(dt).requires_grad_()
            y = f(xi)
            (y * g.to(dt)).sum().backward()
            results.append([y.detach(), xi.grad, *[p.grad.clone() for p in m.parameters()]])
    worst = 0.0  # the compiled layer's worst error / bound (fastpar.tolerance's rule)
    for eager, exact, compiled in zip(*results, strict=True):
        c = tolerance.compare(compiled, eager, exact, length=24, what="compiled MoE")
        worst = max(worst, c.ratio)
    ops = [  # the Function's forward and backward are subgraphs of a higher-order op
        str(n.target)
        for gm in counter.graphs
        for sub in gm.modules()
        if isinstance(sub, torch.fx.GraphModule)
        for n in sub.graph.nodes
        if n.op == "call_function" and "fastpar.all_to_all" in str(n.target)
    ]
    return {"worst": worst, "frames": counter.frame_count, "ops": ops, "pending": _pending()}


@pytest.mark.parametrize(
    "capacity_factor,trace_autograd_ops",
    [(1.0, False), (1.0, True), (None, False)],
    ids=["capacity", "capacity-traced", "dropless"],
)
@pytest.mark.slow  # compiles of the overlapped layer: about 15 s
def test_overlapped_moe_compiled_equals_eager(capacity_factor, trace_autograd_ops):
    """Output and every gradient equal eager. The overlapped Function's backward calls
    torch.autograd.grad, which dynamo traces only with ``trace_autograd_ops``: without it the
    Function runs eagerly inside the compiled layer; with it (capacity mode) its forward, with
    both chunks' start + wait pairs, is in the graph, and the only break left is the layer's
    same-capacity check. Dropless overlap runs eagerly by design (host-built chunk lists)."""
    for out in run_ranks(_moe_compiled, 2, capacity_factor, trace_autograd_ops):
        assert out["worst"] <= 1.0 and out["pending"] == 0, out
        if trace_autograd_ops:
            assert out["frames"] == 2, out  # the same-capacity check splits the layer in two
            starts = [t for t in out["ops"] if "all_to_all_start" in t]
            waits = [t for t in out["ops"] if "all_to_all_wait" in t]
            # forward and backward, 2 chunks each, a dispatch and a combine per chunk
            assert len(starts) == len(waits) == 8, out["ops"]
