"""Triton kernels of the vocab-parallel cross-entropy.

Interpreter tier (``TRITON_INTERPRET=1``, fp32 CPU tensors, Triton forced with
``backend.use_backend("triton")``): each launcher against the torch reference, and the whole op
against the reference op and ``F.cross_entropy`` on the full logits, on 1 and 2 gloo ranks.
GPU tier (``-m cuda``): the kernels natively in fp32 / bf16 / fp16 against the reference, and a
shard of more than 2^31 elements (int64 offsets).

Every comparison is the rule of ``fastpar.tolerance`` (``_parity.agree``): the kernel's error
against the same math in float64 (the reference run on float64 inputs, which it computes in
float64, or torch's F.cross_entropy in float64) at most 4 x the fp32 reference's own + a floor.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
from _ce import compile_for_sm90, compiled_only, grad_kernel_signature, grad_spec, torch_loss
from _parity import agree

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


def _agree_stats(got, single, exact, what: str, *, length: int) -> None:
    """``local_stats``' four columns, each a quantity of its own magnitude, by the rule."""
    assert got.dtype == torch.float32 and got.shape == single.shape, what
    for col, name in enumerate(("row max", "sum of exp", "target logit", "logit sum")):
        agree(got[:, col], single[:, col], exact[:, col], f"{what}: {name}", length=length)


def _exact_grad(x, t, row_max, log_s, g, **args) -> torch.Tensor:
    """The reference's gradient in float64 from the same logits and statistics."""
    return ref.grad_logits(x.double(), t, row_max.double(), log_s.double(), g.double(), **args)


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
    exact = ref.local_stats(x.double(), t, start, n_valid, -100)
    assert got.dtype == torch.float32 and got.shape == (rows, 4)
    _agree_stats(got, want, exact, "stats", length=max(n_valid, 1))


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
    exact = _exact_grad(x, t, row_max, log_s, g, **args)
    agree(got, want, exact, "gradient", length=max(n_valid, 1))
    assert (got[:, n_valid:] == 0).all()
    assert (got[t == -100] == 0).all()


@interpreter
def test_low_precision_inputs_load_as_fp32():
    """fp16 / bf16 loads convert to fp32 in the interpreter; fp16 stores are exact there."""
    x, t = _data(4, 50, seed=3)
    for dtype in (torch.float16, torch.bfloat16):
        xl = x.to(dtype)
        got = _kernels().local_stats(xl, t, 0, 50, -100, block=16)
        want = ref.local_stats(xl, t, 0, 50, -100)
        exact = ref.local_stats(xl.double(), t, 0, 50, -100)  # the same values, exactly
        _agree_stats(got, want, exact, f"{dtype} stats", length=50)
    xh = x.half()
    st = ref.combine_stats(ref.local_stats(xh, t, 0, 50, -100)[None])
    g = torch.ones(4)
    args = grad_spec(0, 50, 50, label_smoothing=0.0, z_loss=0.0)
    got = _kernels().grad_logits(xh, t, st[0], st[1], g, block=16, **args)
    want = ref.grad_logits(xh, t, st[0], st[1], g, **args)
    assert got.dtype == torch.float16
    exact = _exact_grad(xh, t, st[0], st[1], g, **args)
    agree(got, want, exact, "fp16 gradient", length=50, dtype=torch.float16)


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
    kw = dict(reduction=reduction, label_smoothing=alpha, z_loss=z)
    runs = []
    for name in ("triton", "reference"):  # the op, and the pure-torch reference in fp32
        xx = x.clone().requires_grad_()
        with backend.use_backend(name):
            loss = vocab_parallel_cross_entropy(xx, t, **kw)
            loss.sum().backward()
        runs.append((loss.detach(), xx.grad))
    full = x.double().requires_grad_()
    want = torch_loss(full, t, **kw)
    want.sum().backward()
    (loss, grad), (ref_loss, ref_grad) = runs
    length = max(vocab, rows)
    agree(loss, ref_loss, want.detach(), "loss", length=length)
    agree(grad, ref_grad, full.grad, "gradient", length=length)


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
    """Each rank's loss and gradient shard against the reference op on the full logits in fp32
    (one process) and F.cross_entropy in float64, by the rule."""
    results = [pickle.loads(r) for r in run_ranks(_two_rank_triton, 2, vocab, rows)]
    x, t = _data(rows, vocab, seed=11, scale=1.0e4 if rows > 4 else 3.0)
    t[0] = -100
    kw = dict(label_smoothing=0.1, z_loss=1e-4, reduction="none")
    single = x.clone().requires_grad_()
    with backend.use_backend("reference"):
        single_loss = vocab_parallel_cross_entropy(single, t, **kw)
        single_loss.sum().backward()
    full = x.double().requires_grad_()
    want = torch_loss(full, t, **kw)
    want.sum().backward()
    n_local = math.ceil(vocab / 2)

    def padded(grad: torch.Tensor) -> torch.Tensor:
        return torch.cat([grad, grad.new_zeros(rows, 2 * n_local - vocab)], dim=1)

    single_grad, want_grad = padded(single.grad), padded(full.grad)
    for rank, (loss, grad) in enumerate(results):
        cols = slice(rank * n_local, (rank + 1) * n_local)
        agree(loss, single_loss.detach(), want.detach(), f"rank {rank}: loss", length=vocab)
        agree(
            grad, single_grad[:, cols], want_grad[:, cols], f"rank {rank}: gradient", length=vocab
        )


# --- GPU tier -----------------------------------------------------------------------------------


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
    exact_stats = ref.local_stats(x.double(), t, 0, n_valid, -100)
    _agree_stats(
        stats,
        ref.local_stats(x, t, 0, n_valid, -100),
        exact_stats,
        f"{dtype} stats",
        length=n_valid,
    )
    row_max, log_s, _, _ = ref.combine_stats(stats[None])
    g = torch.rand(rows, device="cuda") * (t != -100)
    args = grad_spec(0, n_valid, n_valid)
    got = k.grad_logits(x, t, row_max, log_s, g, **args)
    want = ref.grad_logits(x, t, row_max, log_s, g, **args)
    assert got.dtype == dtype
    exact = _exact_grad(x, t, row_max, log_s, g, **args)
    agree(got, want, exact, f"{dtype} gradient", length=n_valid, dtype=dtype)
    assert (got[:, n_valid:] == 0).all()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_equals_cross_entropy(dtype):
    """The op (Triton) against torch on the same logits in fp32 (the gradient stored in the
    logits' dtype) and in float64, by the rule."""
    x, t = _data(1024, 50257, seed=6, dtype=dtype, device="cuda")
    t[:10] = -100
    kw = dict(label_smoothing=0.1, z_loss=1e-4)
    x.requires_grad_()
    loss = vocab_parallel_cross_entropy(x, t, **kw)
    loss.backward()
    runs = []
    for acc in (torch.float32, torch.float64):
        full = x.detach().to(acc, copy=True).requires_grad_()
        want = torch_loss(full, t, **kw)
        want.backward()
        runs.append((want.detach(), full.grad if acc == torch.float64 else full.grad.to(dtype)))
    (single_loss, single_grad), (exact_loss, exact_grad) = runs
    agree(loss.detach(), single_loss, exact_loss, f"{dtype} loss", length=50257)
    agree(x.grad, single_grad, exact_grad, f"{dtype} gradient", length=50257, dtype=dtype)


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
    exact = ref.local_stats(x[tail].double(), t[tail], 0, cols, -100)
    _agree_stats(stats[tail], want, exact, "last rows' stats", length=cols)
    row_max, log_s, _, _ = ref.combine_stats(stats[None])
    g = torch.ones(rows, device="cuda")
    args = grad_spec(0, cols, cols, label_smoothing=0.0, z_loss=0.0)
    grad = k.grad_logits(x, t, row_max, log_s, g, **args)
    want_grad = ref.grad_logits(x[tail], t[tail], row_max[tail], log_s[tail], g[tail], **args)
    exact_grad = _exact_grad(x[tail], t[tail], row_max[tail], log_s[tail], g[tail], **args)
    agree(
        grad[tail], want_grad, exact_grad, "last rows' gradient", length=cols, dtype=torch.bfloat16
    )


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
