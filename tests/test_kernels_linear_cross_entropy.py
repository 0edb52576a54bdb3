"""Triton path of the fused linear cross-entropy.

Interpreter tier (``TRITON_INTERPRET=1``, fp32 CPU tensors, Triton forced with
``backend.use_backend("triton")``): the in-place gradient kernel against the torch reference,
and the whole op (Triton statistics + in-place gradient, torch matmuls) against the chunked
reference and F.linear + F.cross_entropy, loss and both gradients, on 1, 2 and 4 gloo ranks.
GPU tier (``-m cuda``): the kernel natively in fp32 / bf16 / fp16, the op against torch, and
its peak memory against linear + CE. CPU tier: the kernel (the vocab-parallel CE's gradient
kernel in place) compiles for sm_90.

Every comparison is the rule of ``fastpar.tolerance`` (``_parity.agree``): the error against the
same math in float64 (the CE reference on float64 inputs, or F.linear + F.cross_entropy in
float64: ``fastpar.reference.linear_cross_entropy`` keeps fp32 row statistics whatever the
inputs, so a float64 run of it is not exact) at most 4 x the fp32 reference's own + a floor.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ce import compile_for_sm90, compiled_only, grad_kernel_signature, grad_spec, torch_loss
from _parity import agree

from fastpar.ops import backend
from fastpar.ops.linear_cross_entropy import vocab_parallel_linear_cross_entropy
from fastpar.reference import cross_entropy as ce_ref
from fastpar.reference import linear_cross_entropy as ref
from fastpar.testing import run_ranks

interpreter = pytest.mark.interpreter
cuda = pytest.mark.cuda


def _kernels():
    from fastpar.kernels import linear_cross_entropy as kernels  # defines kernels: lazily

    return kernels


def _ce_kernels():
    from fastpar.kernels import cross_entropy as kernels  # where the kernels are defined

    return kernels


# --- interpreter tier: the in-place gradient kernel against the reference ---------------------

GRAD_CASES = [  # (rows, cols, vocab_start, n_valid, block)
    (1, 123, 0, 123, None),
    (3, 123, 0, 123, 32),  # a ragged last block
    (7, 123, 0, 100, 16),  # 23 padding columns
    (5, 64, 64, 40, 16),  # second shard
    (3, 8, 16, 0, 4),  # only padding
]


@interpreter
@pytest.mark.parametrize(("rows", "cols", "start", "n_valid", "block"), GRAD_CASES)
def test_inplace_grad_kernel_matches_reference(rows, cols, start, n_valid, block):
    gen = torch.Generator().manual_seed(rows * cols + start)
    x = torch.randn(rows, cols, generator=gen) * 3
    x[:, n_valid:] = 1.0e4
    t = torch.randint(0, start + max(n_valid, 1), (rows,), generator=gen)
    t[-1] = -100
    stats = ce_ref.local_stats(x, t, start, n_valid, -100)
    row_max, log_s, _, _ = ce_ref.combine_stats(stats[None])
    g = (torch.rand(rows, generator=gen) + 0.1) * (t != -100)
    args = grad_spec(start, n_valid, start + max(n_valid, 1))
    want = ref.grad_logits_(x.clone(), t, row_max, log_s, g, **args)
    buf = x.clone()
    got = _kernels().grad_logits_(buf, t, row_max, log_s, g, block=block, **args)
    assert got.data_ptr() == buf.data_ptr()  # in place
    exact = ce_ref.grad_logits(
        x.double(), t, row_max.double(), log_s.double(), g.double(), **args
    )  # the same math in float64, from the same statistics
    agree(got, want, exact, "in-place gradient", length=max(n_valid, 1))
    assert (got[:, n_valid:] == 0).all() and (got[t == -100] == 0).all()
    full = ce_ref.grad_logits(x, t, row_max, log_s, g, **args)  # the out-of-place CE gradient
    assert torch.equal(full, want)  # the same arithmetic written elsewhere: bit for bit


@interpreter
def test_inplace_grad_kernel_fp16_buffer():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 50, generator=gen) * 3).half()
    t = torch.randint(0, 50, (4,), generator=gen)
    row_max, log_s, _, _ = ce_ref.combine_stats(ce_ref.local_stats(x, t, 0, 50, -100)[None])
    g = torch.ones(4)
    args = grad_spec(0, 50, 50, label_smoothing=0.0, z_loss=0.0)
    got = _kernels().grad_logits_(x.clone(), t, row_max, log_s, g, block=16, **args)
    want = ref.grad_logits_(x.clone(), t, row_max, log_s, g, **args)
    assert got.dtype == torch.float16
    exact = ce_ref.grad_logits(x.double(), t, row_max.double(), log_s.double(), g.double(), **args)
    agree(got, want, exact, "fp16 in-place gradient", length=50, dtype=torch.float16)


# --- interpreter tier: the whole op under Triton ------------------------------------------------

OP_CASES = [  # (rows, vocab, hidden, reduction, alpha, z, n_ignored, chunk, recompute)
    (1, 37, 8, "mean", 0.0, 0.0, 0, None, False),
    (9, 37, 8, "sum", 0.1, 1e-3, 2, 4, False),
    (9, 37, 8, "none", 0.1, 0.0, 3, 4, True),
    (6, 50, 5, "mean", 0.0, 1e-3, 6, 5, False),  # all ignored: 0, not NaN
    (11, 29, 7, "mean", 0.2, 1e-3, 2, 3, True),
]


def _data(rows, vocab, hidden, n_ignored, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen)
    t = torch.randint(0, vocab, (rows,), generator=gen)
    t[:n_ignored] = -100
    return h, w, t


def _torch(h, w, t, reduction, alpha, z):
    """(loss, d hidden, d weight) of F.linear + F.cross_entropy (+ z·lse²) in float64: the
    exact math."""
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    loss = torch_loss(F.linear(hh, ww), t, label_smoothing=alpha, z_loss=z, reduction=reduction)
    loss.sum().backward()
    return loss.detach(), hh.grad, ww.grad


def _agree_all(got, single, exact, where: str, length: int) -> None:
    """(loss, d hidden, d weight) against the fp32 reference and float64, by the rule."""
    for name, a, b, c in zip(("loss", "d hidden", "d weight"), got, single, exact, strict=True):
        agree(a, b, c, f"{where}: {name}", length=length)


@interpreter
@pytest.mark.parametrize(
    ("rows", "vocab", "hidden", "reduction", "alpha", "z", "n_ignored", "chunk", "recompute"),
    OP_CASES,
)
def test_op_under_triton_equals_reference_and_torch(
    rows, vocab, hidden, reduction, alpha, z, n_ignored, chunk, recompute
):
    h, w, t = _data(rows, vocab, hidden, n_ignored, seed=rows + vocab)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    opts = dict(reduction=reduction, label_smoothing=alpha, z_loss=z, chunk_size=chunk)
    with backend.use_backend("triton"):
        loss = vocab_parallel_linear_cross_entropy(hh, ww, t, recompute=recompute, **opts)
        loss.sum().backward()
    single = ref.linear_cross_entropy(h, w, t, **opts)  # the pure-torch reference, fp32
    exact = _torch(h, w, t, reduction, alpha, z)
    _agree_all(
        (loss.detach(), hh.grad, ww.grad), single, exact, "triton", length=max(rows, vocab, hidden)
    )


def _ranks_under_triton(vocab: int, rows: int, hidden: int) -> bytes:
    """Each rank: the op under Triton on its padded weight shard (padding rows of garbage)."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    h, w, t = _data(rows, vocab, hidden, 2, seed=11)
    n_local = math.ceil(vocab / tp)
    padded = torch.cat([w, torch.full((n_local * tp - vocab, hidden), 30.0)])
    shard = padded[rank * n_local : (rank + 1) * n_local].clone().requires_grad_()
    hh = h.clone().requires_grad_()
    out = []
    with backend.use_backend("triton"):
        for reduction, recompute in (("mean", False), ("none", True)):
            loss = vocab_parallel_linear_cross_entropy(
                hh,
                shard,
                t,
                vocab_size=vocab,
                label_smoothing=0.1,
                z_loss=1e-4,
                reduction=reduction,
                chunk_size=3,
                recompute=recompute,
            )
            gh, gw = torch.autograd.grad(loss.sum(), (hh, shard))
            out.append((loss.detach(), gh, gw))
    return pickle.dumps(out)


@interpreter
@pytest.mark.parametrize(("tp", "vocab", "rows", "hidden"), [(2, 37, 7, 6), (4, 29, 5, 4)])
def test_ranks_under_triton(tp, vocab, rows, hidden):
    """Each rank against the single-process reference on the full weight (fp32) and F.linear +
    F.cross_entropy in float64, by the rule."""
    results = [pickle.loads(r) for r in run_ranks(_ranks_under_triton, tp, vocab, rows, hidden)]
    h, w, t = _data(rows, vocab, hidden, 2, seed=11)
    n_local = math.ceil(vocab / tp)

    def padded(gw: torch.Tensor) -> torch.Tensor:
        return torch.cat([gw, gw.new_zeros(n_local * tp - vocab, hidden)])

    for i, reduction in enumerate(("mean", "none")):
        opts = dict(label_smoothing=0.1, z_loss=1e-4, reduction=reduction, chunk_size=3)
        s_loss, s_h, s_w = ref.linear_cross_entropy(h, w, t, **opts)
        e_loss, e_h, e_w = _torch(h, w, t, reduction, 0.1, 1e-4)
        s_w, e_w = padded(s_w), padded(e_w)
        for rank, (loss, gh, gw) in enumerate(per[i] for per in results):
            rows_ = slice(rank * n_local, (rank + 1) * n_local)
            _agree_all(
                (loss, gh, gw),
                (s_loss, s_h, s_w[rows_]),
                (e_loss, e_h, e_w[rows_]),
                f"{reduction} rank {rank}",
                length=max(rows, vocab, hidden),
            )


# --- GPU tier -----------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(dtype):
    rows, cols, n_valid = 257, 32003, 32000
    x = (torch.randn(rows, cols, device="cuda") * 3).to(dtype)
    t = torch.randint(0, n_valid, (rows,), device="cuda")
    t[::7] = -100
    row_max, log_s, _, _ = ce_ref.combine_stats(ce_ref.local_stats(x, t, 0, n_valid, -100)[None])
    g = torch.rand(rows, device="cuda") * (t != -100)
    args = grad_spec(0, n_valid, n_valid)
    got = _kernels().grad_logits_(x.clone(), t, row_max, log_s, g, **args)
    want = ref.grad_logits_(x.clone(), t, row_max, log_s, g, **args)
    exact = ce_ref.grad_logits(x.double(), t, row_max.double(), log_s.double(), g.double(), **args)
    agree(got, want, exact, f"{dtype} in-place gradient", length=n_valid, dtype=dtype)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_equals_torch_and_saves_memory(dtype):
    n, hidden, vocab = 4096, 1024, 32768
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hidden, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.05).to(dtype)
    w.requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    t[:64] = -100

    def peak(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn()
        grads = torch.autograd.grad(loss, (h, w))
        torch.cuda.synchronize()
        return loss.detach(), grads, torch.cuda.max_memory_allocated() - base

    fused = peak(lambda: vocab_parallel_linear_cross_entropy(h, w, t, label_smoothing=0.1))
    plain = peak(lambda: F.cross_entropy(F.linear(h, w), t, label_smoothing=0.1))
    # d weight (fp32 accumulator for bf16) is on both sides; the logits only on the unfused one
    assert fused[2] < plain[2] / 2, (fused[2], plain[2])
    # against the unfused single run (in the inputs' dtype) and float64, by the rule
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact_loss = F.cross_entropy(F.linear(h64, w64), t, label_smoothing=0.1)
    exact = (exact_loss.detach(), *torch.autograd.grad(exact_loss, (h64, w64)))
    for name, a, b, c in zip(
        ("loss", "d hidden", "d weight"),
        (fused[0], *fused[1]),
        (plain[0], *plain[1]),
        exact,
        strict=True,
    ):
        agree(a, b, c, f"{dtype} {name}", length=max(n, vocab), dtype=dtype)


# --- CPU tier: the kernel compiles for a Hopper GPU (no GPU needed) -----------------------------


@compiled_only
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernels_compile_for_sm90(dtype):
    """The vocab-parallel CE's gradient kernel in place (``IN_PLACE``, ``grad_ptr`` None), as
    ``grad_logits_`` launches it: compiles for sm_90 without spills to local memory."""
    k = _ce_kernels()
    block = k.GRAD_BLOCK
    compiled = compile_for_sm90(
        k._grad_kernel,
        grad_kernel_signature(dtype, in_place=True),
        {"BLOCK": block, "IN_PLACE": True, "grad_ptr": None},
        k._warps(block),
    )
    assert ".local" not in compiled.asm["ptx"]  # no spills to local memory
