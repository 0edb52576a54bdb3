"""Triton kernels of the vocab-parallel cross-entropy.

Interpreter tier (``TRITON_INTERPRET=1``, fp32 CPU tensors, Triton forced with
``backend.use_backend("triton")``): each launcher against the torch reference, and the whole op
against ``F.cross_entropy`` on the full logits, on 1 and 2 gloo ranks.
GPU tier (``-m cuda``): the kernels natively in fp32 / bf16 / fp16 against the reference, and a
shard of more than 2^31 elements (int64 offsets).
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
from _ce import compile_for_sm90, compiled_only, grad_kernel_signature, grad_spec, torch_loss

from fastpar.ops import backend
from fastpar.ops.cross_entropy import vocab_parallel_cross_entropy
from fastpar.reference import cross_entropy as ref
from fastpar.testing import run_ranks

interpreter = pytest.mark.interpreter
cuda = pytest.mark.cuda


def _kernels():
    from fastpar.kernels import cross_entropy as kernels  # defines kernels: import lazily

    return kernels


def _data(rows: int, cols: int, seed: int, scale: float = 3.0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=gen) * scale).to(device=device, dtype=dtype)
    t = torch.randint(0, cols, (rows,), generator=gen).to(device)
    return x, t


# --- interpreter tier: launchers against the reference --------------------------------------

STATS_CASES = [  # (rows, cols, vocab_start, n_valid, block)
    (1, 123, 0, 123, None),
    (1, 123, 0, 123, 32),  # 123 is not a multiple of the block: a ragged last chunk
    (7, 123, 0, 100, 16),  # 23 padding columns (filled with 1e4 below)
    (5, 64, 64, 40, 16),  # second shard: targets below 64 are not in it
    (3, 8, 16, 0, 4),  # a shard made only of padding
]


@interpreter
@pytest.mark.parametrize(("rows", "cols", "start", "n_valid", "block"), STATS_CASES)
def test_stats_kernel_matches_reference(rows, cols, start, n_valid, block):
    x, _ = _data(rows, cols, seed=rows * cols)
    x[:, n_valid:] = 1.0e4
    gen = torch.Generator().manual_seed(1)
    t = torch.randint(0, start + cols + 5, (rows,), generator=gen)
    t[0] = -100
    got = _kernels().local_stats(x, t, start, n_valid, -100, block=block)
    want = ref.local_stats(x, t, start, n_valid, -100)
    assert got.dtype == torch.float32 and got.shape == (rows, 4)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@interpreter
@pytest.mark.parametrize(("rows", "cols", "start", "n_valid", "block"), STATS_CASES)
def test_grad_kernel_matches_reference(rows, cols, start, n_valid, block):
    x, _ = _data(rows, cols, seed=rows + cols)
    x[:, n_valid:] = 1.0e4
    gen = torch.Generator().manual_seed(2)
    t = torch.randint(0, start + max(n_valid, 1), (rows,), generator=gen)
    t[-1] = -100
    row_max = torch.randn(rows, generator=gen) + 3.0
    log_s = torch.rand(rows, generator=gen) + 1.0
    g = torch.rand(rows, generator=gen) * (t != -100)
    args = grad_spec(start, n_valid, start + max(n_valid, 1))
    got = _kernels().grad_logits(x, t, row_max, log_s, g, block=block, **args)
    want = ref.grad_logits(x, t, row_max, log_s, g, **args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got[:, n_valid:] == 0).all()
    assert (got[t == -100] == 0).all()


@interpreter
def test_low_precision_inputs_load_as_fp32():
    """fp16 / bf16 loads convert to fp32 in the interpreter; fp16 stores are exact there."""
    x, t = _data(4, 50, seed=3)
    for dtype in (torch.float16, torch.bfloat16):
        xl = x.to(dtype)
        got = _kernels().local_stats(xl, t, 0, 50, -100, block=16)
        torch.testing.assert_close(got, ref.local_stats(xl, t, 0, 50, -100), rtol=1e-6, atol=1e-5)
    xh = x.half()
    st = ref.combine_stats(ref.local_stats(xh, t, 0, 50, -100)[None])
    g = torch.ones(4)
    args = grad_spec(0, 50, 50, label_smoothing=0.0, z_loss=0.0)
    got = _kernels().grad_logits(xh, t, st[0], st[1], g, block=16, **args)
    want = ref.grad_logits(xh, t, st[0], st[1], g, **args)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


# --- interpreter tier: the whole op under Triton against F.cross_entropy -----------------------

OP_CASES = [  # (rows, vocab, reduction, alpha, z, n_ignored)
    (1, 123, "mean", 0.0, 0.0, 0),
    (9, 123, "sum", 0.1, 1e-3, 2),
    (9, 123, "none", 0.1, 0.0, 3),
    (6, 200, "mean", 0.0, 1e-3, 6),  # all ignored: 0, not NaN
]


@interpreter
@pytest.mark.parametrize(("rows", "vocab", "reduction", "alpha", "z", "n_ignored"), OP_CASES)
def test_op_under_triton_equals_cross_entropy(rows, vocab, reduction, alpha, z, n_ignored):
    x, t = _data(rows, vocab, seed=rows + vocab)
    t[:n_ignored] = -100
    x.requires_grad_()
    with backend.use_backend("triton"):
        loss = vocab_parallel_cross_entropy(
            x, t, reduction=reduction, label_smoothing=alpha, z_loss=z
        )
        loss.sum().backward()
    full = x.detach().double().requires_grad_()
    want = torch_loss(full, t, label_smoothing=alpha, z_loss=z, reduction=reduction)
    want.sum().backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), full.grad, rtol=1e-4, atol=1e-6)


def _two_rank_triton(vocab: int, rows: int) -> bytes:
    """Each rank: Triton forward/backward on its padded shard of the same full logits."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    x, t = _data(rows, vocab, seed=11, scale=1.0e4 if rows > 4 else 3.0)
    t[0] = -100
    n_local = math.ceil(vocab / tp)
    padded = torch.cat([x, torch.full((rows, n_local * tp - vocab), 1.0e4)], dim=1)
    shard = padded[:, rank * n_local : (rank + 1) * n_local].clone().requires_grad_()
    with backend.use_backend("triton"):
        loss = vocab_parallel_cross_entropy(
            shard, t, vocab_size=vocab, label_smoothing=0.1, z_loss=1e-4, reduction="none"
        )
        loss.sum().backward()
    return pickle.dumps((loss.detach(), shard.grad))


@interpreter
@pytest.mark.parametrize(("vocab", "rows"), [(123, 3), (77, 6)])
def test_two_ranks_under_triton(vocab, rows):
    results = [pickle.loads(r) for r in run_ranks(_two_rank_triton, 2, vocab, rows)]
    x, t = _data(rows, vocab, seed=11, scale=1.0e4 if rows > 4 else 3.0)
    t[0] = -100
    full = x.double().requires_grad_()
    want = torch_loss(full, t, label_smoothing=0.1, z_loss=1e-4, reduction="none")
    want.sum().backward()
    n_local = math.ceil(vocab / 2)
    want_grad = torch.cat([full.grad, torch.zeros(rows, 2 * n_local - vocab).double()], dim=1)
    for rank, (loss, grad) in enumerate(results):
        torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(
            grad.double(), want_grad[:, rank * n_local : (rank + 1) * n_local], atol=2e-5, rtol=1e-4
        )


# --- GPU tier -----------------------------------------------------------------------------------

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # rtol; atol = rtol / 10


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "cols", "n_valid"), [(1, 123, 123), (257, 32003, 32000)])
def test_cuda_kernels_match_reference(dtype, rows, cols, n_valid):
    x, t = _data(rows, cols, seed=5, dtype=dtype, device="cuda")
    x[:, n_valid:] = 1.0e4
    t = t.clamp(max=n_valid - 1)
    t[::7] = -100
    k = _kernels()
    stats = k.local_stats(x, t, 0, n_valid, -100)
    torch.testing.assert_close(stats, ref.local_stats(x, t, 0, n_valid, -100), rtol=1e-5, atol=1e-3)
    row_max, log_s, _, _ = ref.combine_stats(stats[None])
    g = torch.rand(rows, device="cuda") * (t != -100)
    args = grad_spec(0, n_valid, n_valid)
    got = k.grad_logits(x, t, row_max, log_s, g, **args)
    want = ref.grad_logits(x, t, row_max, log_s, g, **args)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype] / 10)
    assert (got[:, n_valid:] == 0).all()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_equals_cross_entropy(dtype):
    x, t = _data(1024, 50257, seed=6, dtype=dtype, device="cuda")
    t[:10] = -100
    x.requires_grad_()
    loss = vocab_parallel_cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-4)
    loss.backward()
    full = x.detach().double().requires_grad_()
    want = torch_loss(full, t, label_smoothing=0.1, z_loss=1e-4)
    want.backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        x.grad.double(), full.grad, rtol=TOL[dtype], atol=TOL[dtype] * full.grad.abs().max().item()
    )


@cuda
def test_cuda_more_than_2_31_elements():
    """int64 offsets: 8200 × 262144 bf16 (> 2^31 elements); check the last rows against torch."""
    rows, cols = 8200, 262144
    assert rows * cols > 2**31
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, cols, (rows,), device="cuda")
    k = _kernels()
    stats = k.local_stats(x, t, 0, cols, -100)
    tail = slice(rows - 4, rows)
    want = ref.local_stats(x[tail], t[tail], 0, cols, -100)
    torch.testing.assert_close(stats[tail], want, rtol=1e-5, atol=1e-2)
    row_max, log_s, _, _ = ref.combine_stats(stats[None])
    g = torch.ones(rows, device="cuda")
    args = grad_spec(0, cols, cols, label_smoothing=0.0, z_loss=0.0)
    grad = k.grad_logits(x, t, row_max, log_s, g, **args)
    want_grad = ref.grad_logits(x[tail], t[tail], row_max[tail], log_s[tail], g[tail], **args)
    torch.testing.assert_close(grad[tail].float(), want_grad.float(), rtol=1e-2, atol=1e-4)


# --- CPU tier: the kernels compile for a Hopper GPU (no GPU needed) -----------------------------


def _signatures(dtype: str) -> dict:
    stats = {
        "logits_ptr": f"*{dtype}",
        "target_ptr": "*i64",
        "stats_ptr": "*fp32",
        "row_stride": "i32",
        "vocab_start": "i32",
        "n_valid": "i32",
        "ignore_index": "i32",
        "BLOCK": "constexpr",
    }
    return {"_stats_kernel": stats, "_grad_kernel": grad_kernel_signature(dtype)}


@compiled_only
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernels_compile_for_sm90(dtype):
    """Catches type errors of the compiled (not interpreted) path on a machine without a GPU."""
    k = _kernels()
    for name, sig in _signatures(dtype).items():
        block = k.MAX_BLOCK if name == "_stats_kernel" else k.GRAD_BLOCK
        flags = {} if name == "_stats_kernel" else {"IN_PLACE": False}
        compile_for_sm90(getattr(k, name), sig, {"BLOCK": block, **flags}, k._warps(block))
