"""``torch.compile`` of the MoE layer and of a model built like the trainer's default equals eager:
outputs, the aux loss and every gradient (fp32). Graphs are counted with dynamo's compile counter
(frames = graph breaks + 1).

* EP = 1, dropless and capacity: one graph (``fullgraph=True``); no recompile when the routing
  changes (no host-dependent specialisation).
* EP = 2 over gloo, dropless with uneven token counts: one graph with ``fullgraph=True``
  (inductor; the dispatch op's received-row count is an unbacked size) or with
  ``capture_dynamic_output_shape_ops``; otherwise dynamo breaks only at the dispatch op
  (``fastpar.moe.dispatch``). The overlapped path (``overlap_chunks > 1``) runs eagerly inside
  the compiled layer (``torch.compiler.disable``).
* EP = 2, capacity: breaks only at the same-capacity check (an all-gather read on the host).

Every layer sets ``aux_loss_scale`` as ``fastpar.train`` does: a layer that reads the
``aux_loss_scale(...)`` context variable instead breaks the graph there (dynamo cannot trace
``ContextVar.get``). Inductor compiles are slow on two cores: the models are tiny, and the
aot_eager backend (dynamo + AOT autograd + the ops' fake implementations) covers most cases.

Compiled against eager is not bit for bit (AOT autograd traces its own backward graph, inductor
generates its own kernels: other summation orders), so each result is judged by
``fastpar.tolerance``'s rule (docs/tolerances.md): its error against the eager module's float64
copy at most 4 x eager fp32's own plus a floor. Inductor cannot compile under
``ATEN_CPU_CAPABILITY=default`` (its C++ code then fails to build: ``at::vec has not been
declared``, a torch limitation): that test is skipped there.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from _mesh import make_mesh
from _parity import NO_INDUCTOR, agree, exact_copy
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from fastpar.models import build_model, lm_loss
from fastpar.moe import MoE, grouped
from fastpar.testing import run_ranks
from fastpar.train.config import TrainConfig


def _inductor_config():
    """``torch._inductor.config`` as ``sys.modules`` holds it, fully imported: ``import
    torch._inductor.config as c`` reads the attribute ``config`` of the package first, which a
    partly imported package may not have yet (a ``-k`` selection of these tests failed on that)."""
    return importlib.import_module("torch._inductor.config")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with _inductor_config().patch(compile_threads=1):  # no worker pool (2 cores)
        yield
    torch._dynamo.reset()


def _eager_and_compiled(module: nn.Module, xs, backend: str, fullgraph: bool, exact=None):
    """[(eager results, compiled results, float64 results)] for each input of ``xs``, and the
    compile counter. Results: output, aux loss, input grad, every parameter grad. ``exact``:
    ``module``'s float64 copy (``exact_copy``, made before any forward; default: made here)."""
    exact = exact_copy(module) if exact is None else exact
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(module, backend=counter, fullgraph=fullgraph)

    def run(f, m, x, g):
        m.zero_grad(set_to_none=True)
        dtype = next(m.parameters()).dtype
        x = x.to(dtype, copy=True).requires_grad_()
        y = f(x)
        (y * g.to(dtype)).sum().backward()
        aux = m.aux_loss.detach() if isinstance(m, MoE) else torch.zeros((), dtype=dtype)
        return [y.detach(), aux, x.grad, *[p.grad for p in m.parameters()]]

    triples = []
    for i, x in enumerate(xs):
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + i))
        triples.append(
            (run(module, module, x, g), run(compiled, module, x, g), run(exact, exact, x, g))
        )
    return triples, counter


def _assert_agree(triples, length: int) -> None:
    """Compiled against eager by the rule (eager in fp32 and in float64)."""
    for want, got, exact in triples:
        assert len(want) == len(got) == len(exact)
        for i, (a, b, e) in enumerate(zip(got, want, exact, strict=True)):
            agree(a, b, e, f"result {i}", length=length)


def _inputs(n: int, shape, skew: float = 2.0, seed: int = 0):
    """``n`` inputs, the first half of the tokens shifted (uneven expert loads)."""
    xs = []
    for i in range(n):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed + i))
        x[..., : shape[-2] // 2, :] += skew * (i + 1)
        xs.append(x)
    return xs


def _layer(expert: str, capacity_factor, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(8, 12, 4, 2, capacity_factor=capacity_factor, expert=expert, z_loss_coef=1e-3, **kw)
    moe.aux_loss_scale = 0.5
    return moe


# -- the grouped linear op ------------------------------------------------------------------


@pytest.mark.parametrize("k,m", [(8, 16), (5, 3)])  # 16-byte strides (torch._grouped_mm), odd
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_equals_per_group_matmuls(k, m, bias):
    counts = [3, 0, 6, 2]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), k, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), k, m, generator=gen, requires_grad=True)
    b = torch.randn(len(counts), m, generator=gen, requires_grad=True) if bias else None
    offs = grouped.offsets(torch.tensor(counts))
    g = torch.randn(sum(counts), m, generator=gen)
    params = [x, w] + ([b] if bias else [])
    params64 = [t.detach().double().requires_grad_() for t in params]

    def per_group(x, w, b=None):
        parts = x.split(counts)
        return torch.cat([p @ w[e] + (b[e] if bias else 0) for e, p in enumerate(parts)])

    want, exact = per_group(*params), per_group(*params64)
    want_grads = torch.autograd.grad(want, params, g)
    exact_grads = torch.autograd.grad(exact, params64, g.double())
    for f in (grouped.grouped_linear, grouped._op):  # eager Function, compile-time custom op
        y = f(x, w, b, offs)
        # bit for bit: on a CPU each group's rows are one mm of the same slices as the loop's,
        # and the bias one add of the same numbers
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        grads = torch.autograd.grad(y, params, g)
        for name, a, e, e64 in zip("xwb", grads, want_grads, exact_grads, strict=False):
            agree(a, e, e64, f"grad {name}", length=max(sum(counts), k, m))
    torch.library.opcheck(grouped._op, (x, w, b, offs))


# -- EP = 1 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_layer_one_graph_equals_eager(expert, capacity_factor):
    triples, counter = _eager_and_compiled(
        _layer(expert, capacity_factor), _inputs(3, (3, 7, 8)), "aot_eager", fullgraph=True
    )
    _assert_agree(triples, length=21)  # the tokens (a weight gradient's sum), wider than 12
    assert counter.frame_count == 1


def test_trainer_default_model_shape_one_graph_equals_eager():
    """The trainer's default model config (GPT, every 2nd block a dropless top-2 MoE over 4
    experts), shrunk to 2 layers / width 32 / 16 tokens for time; one graph."""
    cfg = dataclasses.replace(TrainConfig.from_flags().model, layers=2, hidden=32, seq_len=16)
    assert cfg.capacity_factor is None and cfg.moe_every == 2
    torch.manual_seed(0)
    model = nn.Sequential(*build_model(cfg))
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = 0.25
    ids = [
        torch.randint(
            0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(i)
        )
        for i in range(2)
    ]
    model64 = exact_copy(model)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda t: lm_loss(model(t), t, cfg), backend=counter, fullgraph=True)
    length = max(2 * cfg.seq_len, *(max(p.shape) for p in model.parameters()))
    for t in ids:
        results = []
        for m, f in (
            (model, lambda t: lm_loss(model(t), t, cfg)),
            (model, step),
            (model64, lambda t: lm_loss(model64(t), t, cfg)),
        ):
            m.zero_grad(set_to_none=True)
            loss = f(t)
            loss.backward()
            results.append([loss.detach(), *[p.grad for p in m.parameters()]])
        _assert_agree([tuple(results)], length)
    assert counter.frame_count == 1


# -- EP = 2 over gloo -------------------------------------------------------------------------


def _ep_compiled(capacity_factor, backend: str, fullgraph: bool, overlap_chunks: int = 1):
    """On each EP rank: eager vs compiled over two routings; returns (compiled frames, the
    graph-break reasons torch._dynamo.explain reports for one call)."""
    _inductor_config().compile_threads = 1  # this forked rank only
    rank = dist.get_rank()
    moe = _layer("mlp", capacity_factor, mesh=make_mesh(ep=2), overlap_chunks=overlap_chunks)
    moe64 = exact_copy(moe)  # the same EP layer in float64: the exact math
    tokens = 5 + 3 * rank if capacity_factor is None else 6  # dropless: uneven per rank
    xs = _inputs(2, (2, tokens, 8), seed=10 * rank)
    explained = torch._dynamo.explain(moe)(xs[0])
    reasons = [b.reason.splitlines()[0] + " " + b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    triples, counter = _eager_and_compiled(moe, xs, backend, fullgraph, exact=moe64)
    _assert_agree(triples, length=2 * 2 * 8)  # both ranks' tokens can reach an expert
    return counter.frame_count, reasons


def _one_cause(results, *words: str) -> None:
    for _, reasons in results:
        assert reasons, "expected a graph break"
        for r in reasons:
            assert all(w in r for w in words), r


@NO_INDUCTOR
@pytest.mark.slow  # inductor: about 40 s on 2 cores
def test_ep2_dropless_inductor_fullgraph_equals_eager():
    """fullgraph=True lets dynamo keep the dispatch op's data-dependent row count (an unbacked
    size): one graph for both routings."""
    out = run_ranks(_ep_compiled, 2, None, "inductor", True, timeout=300)
    assert [frames for frames, _ in out] == [1, 1]


def test_ep2_dropless_without_fullgraph_breaks_only_at_the_dispatch():
    out = run_ranks(_ep_compiled, 2, None, "aot_eager", False, timeout=120)
    _one_cause(out, "Dynamic shape operator", "fastpar.moe_ep_dispatch")


def _ep_capture_dynamic_shapes():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        return _ep_compiled(None, "aot_eager", False)


def test_ep2_dropless_one_graph_when_dynamic_output_shapes_are_captured():
    out = run_ranks(_ep_capture_dynamic_shapes, 2, timeout=120)
    assert [frames for frames, _ in out] == [1, 1]


def test_ep2_dropless_overlapped_runs_eagerly_inside_the_compiled_layer():
    out = run_ranks(_ep_compiled, 2, None, "aot_eager", False, 2, timeout=120)
    _one_cause(out, "torch.compiler.disable", "_dropless_overlapped")


def test_ep2_capacity_breaks_only_at_the_capacity_check():
    out = run_ranks(_ep_compiled, 2, 1.0, "aot_eager", False, timeout=120)
    _one_cause(out, "torch.compiler.disable", "_check_same_capacity")
