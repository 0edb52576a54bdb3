"""One GPU, a Llama shape of about 1.7 B parameters (hidden 2048, 24 layers, 16 heads over 8 KV
heads, SwiGLU 8192, 32,000 tokens, untied), one training step of 4 x 2048 tokens in bf16 and in
fp8 (each recipe), fp32 master weights and AdamW as the trainer runs them: step time, tokens/s
and MFU (the trainer's count, ``docs/training.md``, against the GPU's dense bf16 peak for both:
an fp8 step is compared with bf16's, not with fp8's own peak). Issue 47's goals: bf16 >= 45 %
MFU, fp8 >= 1.2x bf16's step. CUDA only (``bench/gpu_check.py`` runs it); skipped elsewhere.
Run:  pytest bench/test_bench_train_gpu.py -s --benchmark-json=...
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from fastpar.train import TrainConfig, launch

SHAPE = dict(
    model_type="llama",
    hidden=2048,
    layers=24,
    heads=16,
    kv_heads=8,
    ffn=8192,
    vocab_size=32000,
    seq_len=2048,
    untied=True,
)
CASES = {
    "bf16": dict(precision="bf16"),
    "fp8-tensorwise": dict(precision="fp8", fp8_recipe="tensorwise"),
    "fp8-rowwise": dict(precision="fp8", fp8_recipe="rowwise"),
}


def _step(case: str, metrics: Path, **extra) -> tuple[TrainConfig, list[dict]]:
    """Train ``case`` for 6 steps; (its config, the metrics rows of steps 3-6: the first two
    warm the allocator and the kernels)."""
    cfg = TrainConfig.from_flags(
        tp=1,
        pp=1,
        dp=1,
        ep=1,
        batch_size=4,
        steps=6,
        quiet=True,
        log_every=1,
        metrics_file=str(metrics),
        **{**SHAPE, **CASES[case], **extra},
    )
    launch(cfg)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return cfg, [r for r in rows if "mfu" in r and r.get("step", 0) > 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a 1.7 B training step needs a GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_llama_1p7b_step_on_one_gpu(benchmark, case, tmp_path):
    benchmark.group = "train-step-gpu"
    cfg, rows = benchmark.pedantic(
        _step, args=(case, tmp_path / "metrics.jsonl"), rounds=1, iterations=1
    )
    tps = statistics.median(r["tokens_per_s"] for r in rows)
    mfu = statistics.median(r["mfu"] for r in rows) if rows[0]["mfu"] is not None else None
    benchmark.extra_info.update(
        tokens_per_second=tps, mfu=mfu, case=case, flops_per_token=rows[0]["flops_per_token"]
    )
    mfu_text = f", MFU {mfu:.1%} of the bf16 peak" if mfu is not None else ""
    print(f"\n{case}: {tps:,.0f} tokens/s{mfu_text} (hidden {cfg.model.hidden})")
