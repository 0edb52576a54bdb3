"""Fused AdamW kernels: the cached multi-tensor pointer tables, the aligned /
unaligned split, and the compiled code.

* CPU tier: a device table is built once per set of pointers and numels and reused on later
  steps (no rebuild, no copy); new pointers (e.g. reallocated gradients) make a new table; the
  cache is bounded. Compiled for sm_90 with the alignment of a real launch, the flat and the
  multi-tensor kernels use 128-bit global loads and stores, at most ``REGISTER_BUDGET``
  registers, and spill nothing.
* Interpreter tier: tensors that do not start on a 16-byte boundary (views at an odd offset)
  take the unhinted group and still agree with the reference, next to aligned ones (by the rule
  of ``fastpar.tolerance``: against AdamW written out in float64).
* GPU tier: a step after the first is captured in a CUDA graph and replays like eager steps.
"""

from __future__ import annotations

import os

import pytest
import torch
from _adamw import exact_adamw
from _ce import ptxas_usage
from _parity import agree

from fastpar.ops import adamw as op
from fastpar.ops import backend

interpreter = pytest.mark.interpreter
HYPER = dict(lr=1e-3, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.1)
REGISTER_BUDGET = 96


def _kernels():
    from fastpar.kernels import adamw as kernels  # defines kernels: import lazily

    return kernels


def _rows(n_tensors: int, numel: int = 300, lp: bool = False):
    """(pointers, numels) of ``n_tensors`` tensors (kept alive in ``_ALIVE``)."""
    k = _kernels()
    step = torch.zeros((), dtype=torch.int64)
    pointers = []
    for _ in range(n_tensors):
        row = [torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)]
        row += [torch.empty(numel, dtype=torch.bfloat16) if lp else None, step]
        _ALIVE.append(row)
        pointers.append(k._pointers(*row))
    return pointers, [numel] * n_tensors


_ALIVE: list = []


def test_pointer_tables_are_built_once_per_parameter_set(monkeypatch):
    k = _kernels()
    k._TABLES.clear()
    built = []
    real = k._build_table
    monkeypatch.setattr(k, "_build_table", lambda *a: built.append(1) or real(*a))
    cpu = torch.device("cpu")
    pointers, numels = _rows(5, lp=True)
    first = k._device_table(pointers, numels, 256, cpu)
    for _ in range(3):  # later steps: the same table object, nothing rebuilt
        assert k._device_table(list(pointers), list(numels), 256, cpu)[0] is first[0]
    assert len(built) == 1
    table, n_programs = first
    assert n_programs == 5 * 2  # 300 elements in chunks of 256
    assert table[:5].tolist() == [p[0] for p in pointers]  # the params' pointers first
    assert table[6 * 5 : 7 * 5].tolist() == numels
    assert table[7 * 5 : 7 * 5 + n_programs].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert table[7 * 5 + n_programs :].tolist() == [0, 256] * 5
    # new gradients (set_to_none + a new backward): another table; the old one is kept
    regrad = [(p, g + 8, *rest) for p, g, *rest in pointers]
    assert k._device_table(regrad, numels, 256, cpu)[0] is not first[0]
    assert len(built) == 2
    assert k._device_table(pointers, numels, 256, cpu)[0] is first[0]
    k._device_table(pointers, numels, 512, cpu)  # another chunk size: another table
    assert len(built) == 3
    for _ in range(k.TABLE_CACHE_SIZE + 3):
        k._device_table(*_rows(1), 256, cpu)
    assert len(k._TABLES) == k.TABLE_CACHE_SIZE
    k._TABLES.clear()
    _ALIVE.clear()


@interpreter
def test_unaligned_tensors_take_the_unhinted_group_and_match_the_reference():
    """A view one element into a buffer is 4 bytes off a 16-byte boundary: it must not be
    hinted aligned (that would be undefined on a GPU); it runs in its own launch."""
    k = _kernels()
    sizes = [4099, 130, 1]
    outs = []
    for name in ("triton", "reference"):
        gen = torch.Generator().manual_seed(0)
        bases = [torch.randn(n + 1, generator=torch.Generator().manual_seed(n)) for n in sizes]
        params = [bases[0][1:], bases[1][:-1], bases[2][1:]]  # [0], [2] unaligned, [1] aligned
        p0 = [p.clone() for p in params]
        grads = [torch.randn(n, generator=gen) for n in sizes]
        state = [(torch.zeros(n), torch.zeros(n)) for n in sizes]
        assert [k._aligned((p.data_ptr(),) * 5) for p in params] == [False, True, False]
        step = torch.zeros(())
        with backend.use_backend(name):
            for _ in range(2):
                step += 1
                op.adamw_step_multi_(
                    params,
                    grads,
                    [s[0] for s in state],
                    [s[1] for s in state],
                    steps=step,
                    **HYPER,
                )
        outs.append([t.clone() for t in params])
    hyper = {key: HYPER[key] for key in ("lr", "beta1", "beta2", "eps", "weight_decay")}
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        exact = exact_adamw(p0[i], [grads[i]] * 2, **hyper)[0]  # two steps, the same grads
        agree(a, b, exact, f"param {i} after two steps", length=1)


@pytest.mark.cuda
def test_a_warmed_up_multi_tensor_step_captures_in_a_cuda_graph():
    """After one step (which builds and copies the table) a step is capturable: replaying the
    graph equals running the steps eagerly; capturing before any step is a clear error."""
    sizes = [4099, 130, 1]

    def make():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.randn(n, generator=gen).cuda() for n in sizes]
        gs = [torch.randn(n, generator=gen).cuda().bfloat16() for n in sizes]
        return ps, gs, [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]

    def step_fn(ps, gs, ms, vs, step):
        step += 1
        op.adamw_step_multi_(ps, gs, ms, vs, steps=step, **HYPER)

    _kernels()._TABLES.clear()
    eager, graphed = make(), make()
    eager_step, graph_step = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    with backend.use_backend("triton"):
        capture = torch.cuda.graph(torch.cuda.CUDAGraph())
        with pytest.raises(RuntimeError, match="run one optimizer step before capturing"), capture:
            step_fn(*graphed, graph_step)
        graph_step.zero_()
        for _ in range(3):
            step_fn(*eager, eager_step)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step_fn(*graphed, graph_step)  # warm-up: compiles, builds the table
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step_fn(*graphed, graph_step)
        graph.replay()
        graph.replay()
    torch.cuda.synchronize()
    assert float(graph_step) == float(eager_step) == 3.0
    for a, b in zip(
        eager[0] + eager[2] + eager[3], graphed[0] + graphed[2] + graphed[3], strict=True
    ):
        assert torch.equal(a, b)


# --- CPU tier: compiled for sm_90 ---------------------------------------------------------------

FLAT_SIG = {
    "p_ptr": "*fp32",
    "g_ptr": "*{g}",
    "m_ptr": "*{m}",
    "v_ptr": "*{m}",
    "lp_ptr": "*{lp}",
    "step_ptr": "*i64",
    "scale_ptr": "*fp32",
    "clip_ptr": "*fp32",
    "inf_ptr": "*fp32",
    "numel": "i64",
}
MULTI_SIG = {
    "table": "*i64",
    "num_tensors": "i32",
    "block_tensor": "*i64",
    "block_start": "*i64",
    "scale_ptr": "*fp32",
    "clip_ptr": "*fp32",
    "inf_ptr": "*fp32",
}
SCALARS = {"lr_bits": "i64", "beta1_bits": "i64", "beta2_bits": "i64"}
SCALARS |= dict.fromkeys(("decay", "w1", "beta2", "w2", "eps"), "fp32")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the real JIT")
@pytest.mark.parametrize("form", ["flat", "multi"])
@pytest.mark.parametrize(
    "g,lp,m",
    [
        ("fp32", None, "fp32"),
        ("bf16", "bf16", "fp32"),
        ("fp16", "fp16", "fp32"),
        ("bf16", "bf16", "bf16"),
    ],
    ids=["fp32", "bf16-copy", "fp16-copy", "bf16-moments"],
)
def test_kernels_compile_to_wide_accesses_within_the_register_budget(form, g, lp, m, tmp_path):
    """Every flag on (unscale, clip, inf skip, weight decay, a copy when ``lp``), 16-byte aligned
    pointers as Triton specialises them on a real launch (flat) or as the launcher hints them
    (multi, ``ALIGNED``): 128-bit loads and stores, no spills, <= ``REGISTER_BUDGET``."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _kernels()
    tl_dtypes = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
    flags = dict(HAS_SCALE=True, HAS_CLIP=True, HAS_INF=True, HAS_WD=True, HAS_LP=lp is not None)
    flags |= dict(LP_DTYPE=tl_dtypes[lp or "fp32"], MAXIMIZE=False, SMALL_W1=True)
    flags |= dict(CHUNK=k.CHUNK, BLOCK=k.BLOCK)
    if form == "flat":
        kernel = k._adamw_flat_kernel
        sig = {n: a.format(g=g, lp=lp or "fp32", m=m) for n, a in FLAT_SIG.items()} | SCALARS
    else:
        kernel = k._adamw_multi_kernel
        sig = MULTI_SIG | SCALARS
        flags |= dict(G_DTYPE=tl_dtypes[g], M_DTYPE=tl_dtypes[m], STEP_DTYPE=tl.int64)
        flags |= dict(ALIGNED=True)
    full = sig | dict.fromkeys(flags, "constexpr")
    aligned = [i for i, (n, a) in enumerate(sig.items()) if a.startswith("*")]
    source = ASTSource(
        kernel, full, constexprs=flags, attrs={(i,): [["tt.divisibility", 16]] for i in aligned}
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": k.NUM_WARPS, "enable_fp_fusion": False},
    )
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, f"{form} {g}: no 128-bit accesses"
    regs, spills = ptxas_usage(ptx, tmp_path)
    assert spills == 0, (form, g, spills)
    assert regs <= REGISTER_BUDGET, (form, g, regs)
