"""Cross-entropy over the vocabulary: provider × size × {forward, backward, full} (one rank).

Providers: ``fastpar`` (Triton on a GPU, the torch reference on a CPU), ``torch``
(``F.cross_entropy``), ``torch_compile`` (``torch.compile(F.cross_entropy, dynamic=True)``; on a
CPU only with FASTPAR_BENCH_COMPILE=1, as compiling costs about 30 s a shape there) and
``liger`` (``LigerCrossEntropyLoss``, GPU only, when ``liger_kernel`` imports).

Sizes: on a GPU, bf16 logits, vocab 32k / 128k / 256k × tokens 1k / 4k / 16k; on a CPU, fp32,
vocab 32k × 1k and 8k × 512 tokens (compare the providers' ratios, not absolute times).
``extra_info``: bytes moved (compulsory: forward reads the logits once; backward reads them and
writes the gradient once; full is both), and on a GPU the peak memory allocated during one call
and the fraction of the device's peak HBM bandwidth (H200 4.8 TB/s, H100 3.35 TB/s; bytes/s
only for other devices). Peak memory is not measured on a CPU (no allocator statistics).

Run:  pytest bench/test_bench_cross_entropy.py --benchmark-json=bench/results/cross_entropy.json
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from _common import record_bandwidth, record_peak_memory

from fastpar.ops.cross_entropy import vocab_parallel_cross_entropy

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
if CUDA:
    SIZES = [(v, n) for v in (32768, 131072, 262144) for n in (1024, 4096, 16384)]
    ROUNDS, WARMUP = 10, 2
else:
    SIZES = [(32768, 1024), (8192, 512)]
    ROUNDS, WARMUP = 5, 1


@functools.cache
def _compiled():
    return torch.compile(F.cross_entropy, dynamic=True)


def _liger():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except Exception as exc:  # not installed, or broken
        pytest.skip(f"liger_kernel does not import: {type(exc).__name__}: {exc}")
    return LigerCrossEntropyLoss()


def _loss_fn(provider: str):
    if provider == "fastpar":
        return vocab_parallel_cross_entropy
    if provider == "torch":
        return F.cross_entropy
    if provider == "torch_compile":
        if not CUDA and os.environ.get("FASTPAR_BENCH_COMPILE") != "1":
            pytest.skip("torch.compile takes ~30 s a shape on CPU; set FASTPAR_BENCH_COMPILE=1")
        return _compiled()
    if provider == "liger":
        if not CUDA:
            pytest.skip("Liger-Kernel runs Triton on CUDA tensors only")
        return _liger()
    raise ValueError(provider)


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("mode", ["forward", "backward", "full"])
@pytest.mark.parametrize(("vocab", "tokens"), SIZES, ids=[f"V{v}-N{n}" for v, n in SIZES])
@pytest.mark.parametrize("provider", ["fastpar", "torch", "torch_compile", "liger"])
def test_cross_entropy(benchmark, provider, vocab, tokens, mode):
    loss_fn = _loss_fn(provider)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=DEVICE, dtype=DTYPE, generator=gen)
    logits.requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    try:
        loss = loss_fn(logits, target)  # warm-up: compiles / autotunes
        torch.autograd.grad(loss, logits)
        _sync()
    except Exception as exc:
        if provider == "torch_compile":
            pytest.skip(f"torch.compile fails here: {type(exc).__name__}: {exc}")
        raise

    if mode == "forward":

        def run():
            with torch.no_grad():
                out = loss_fn(logits, target)
            _sync()
            return out

    elif mode == "backward":
        loss = loss_fn(logits, target)

        def run():
            out = torch.autograd.grad(loss, logits, retain_graph=True)
            _sync()
            return out

    else:

        def run():
            out = torch.autograd.grad(loss_fn(logits, target), logits)
            _sync()
            return out

    benchmark.group = f"cross_entropy-{mode}-V{vocab}-N{tokens}"
    elem = logits.element_size() * logits.numel()
    moved = {"forward": elem, "backward": 2 * elem, "full": 3 * elem}[mode]
    benchmark.extra_info.update(
        provider=provider,
        mode=mode,
        vocab=vocab,
        tokens=tokens,
        dtype=str(DTYPE),
        device=torch.cuda.get_device_name(0) if CUDA else "cpu",
        compulsory_bytes=moved,
    )
    record_peak_memory(benchmark, run)

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)

    record_bandwidth(benchmark, moved)
