"""parallelize's check against building the model it checks: a Hugging Face Llama at TP 2 over
gloo on CPU ranks, per rank: the model's build (``LlamaForCausalLM(config)``, random init),
``parallelize`` with ``check=False`` and with the full check, and torch's own TP
(``parallelize_module`` with ColwiseParallel / RowwiseParallel over the same projections),
alternating, in CPU seconds of the rank (``time.process_time``: the other rank's share of the 2
cores is not counted). The result is the check's cost over the build,
(check=True - check=False) / build, per model shape (docs/hf.md, "The check").
Run:  pytest bench/test_bench_parallelize_check.py --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from fastpar.testing import run_ranks

SHAPES = {  # layers, hidden, vocab
    "4M-4layers": (4, 256, 2048),
    "7M-8layers": (8, 256, 2048),
    "3M-4layers-wide-vocab": (4, 128, 8192),
    "13M-16layers": (16, 256, 2048),
    "1.3M-4layers-hidden128": (4, 128, 2048),  # the check's fixed cost over a tiny build
}


def _torch_tp(model, mesh, layers: int) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for i in range(layers):
        at = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"{at}.{name}"] = ColwiseParallel()
        plan[f"{at}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{at}.mlp.gate_proj"] = plan[f"{at}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{at}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _side_by_side(layers: int, hidden: int, vocab: int, reps: int) -> dict:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import fastpar
    from fastpar.nn import parallelize

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    mesh = fastpar.init(tp=2)
    device_mesh = init_device_mesh("cpu", (2,))
    times: dict[str, list[float]] = {"build": [], "off": [], "check": [], "torch_tp": []}

    def timed(key, fn):
        t0 = time.process_time()
        out = fn()
        times[key].append(time.process_time() - t0)
        return out

    for _ in range(reps + 1):  # the first round warms the caches: dropped
        for key in ("off", "check", "torch_tp"):
            torch.manual_seed(0)
            model = timed("build", lambda: transformers.LlamaForCausalLM(config))
            if key == "torch_tp":
                timed(key, lambda m=model: _torch_tp(m, device_mesh, layers))
            else:
                timed(key, lambda m=model, k=key: parallelize(m, mesh=mesh, check=k == "check"))
    params = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    return {"params": params, **{k: statistics.median(v[3:]) for k, v in times.items()}}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_check_cost_over_the_build(benchmark, shape):
    benchmark.group = "parallelize-check"
    results = benchmark.pedantic(
        run_ranks, args=(_side_by_side, 2, *SHAPES[shape], 5), rounds=1, iterations=1
    )
    med = {k: max(r[k] for r in results) for k in ("build", "off", "check", "torch_tp")}
    cost = (med["check"] - med["off"]) / med["build"]
    benchmark.extra_info.update(
        params=results[0]["params"],
        build_ms=med["build"] * 1e3,
        parallelize_off_ms=med["off"] * 1e3,
        parallelize_check_ms=med["check"] * 1e3,
        torch_tp_ms=med["torch_tp"] * 1e3,
        check_over_build=cost,
    )
    print(
        f"\n{shape} ({results[0]['params'] / 1e6:.1f} M parameters), CPU s of the slower rank: "
        f"build {med['build']:.4f}, parallelize check=False {med['off']:.4f}, check=True "
        f"{med['check']:.4f}, torch parallelize_module {med['torch_tp']:.4f}; the check costs "
        f"{cost:.2f}x the build"
    )
