"""Selective recompute, measured: bytes kept for backward and step time of a small Llama block
stack (single process, CPU) under --recompute none / attention / mlp / every:2 / full.

* Kept bytes: after the forward, what backward holds — the tensors autograd saved (counted with
  ``torch.autograd.graph.saved_tensors_hooks``; inside a checkpointed region torch's own hooks
  take over, so nothing is counted there) plus each checkpointed region's inputs (which the
  checkpoint keeps). ``full`` is the pipeline engine's mechanism: only the stage input is kept.
  The one region being recomputed during backward (transient) is not counted.
* Step time: forward + backward, median of a few rounds, side by side in one run (ratios to
  none matter, not the absolute numbers).
Run:  pytest bench/test_bench_recompute.py -s --benchmark-json=bench/results/recompute.json
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from fastpar.models import LlamaConfig, build_llama
from fastpar.parallel.pipeline import apply_recompute

CFG = LlamaConfig(vocab_size=256, seq_len=256, hidden=256, heads=8, kv_heads=4, layers=4)
BATCH, ROUNDS = 4, 5
POLICIES = ("none", "attention", "mlp", "every:2", "full")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure(policy: str) -> dict:
    torch.manual_seed(0)
    layers = build_llama(CFG)[1:-1]
    regions = apply_recompute(layers, policy)
    stack = nn.Sequential(*layers)
    held = [0]
    for r in regions:  # a checkpoint keeps its region's inputs
        r.register_forward_pre_hook(lambda m, args: held.__setitem__(0, held[0] + _nbytes(args[0])))

    def pack(t):
        held[0] += _nbytes(t)
        return t

    x = torch.randn(BATCH, CFG.seq_len, CFG.hidden, requires_grad=True)
    times = []
    for _ in range(ROUNDS):
        held[0] = 0
        t0 = time.perf_counter()
        if policy == "full":  # the engine's: a forward without graph, then recomputed
            with torch.no_grad():
                stack(x)
            kept = _nbytes(x)
            out = stack(x)
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = stack(x)
            kept = held[0]
        out.float().pow(2).mean().backward()
        times.append(time.perf_counter() - t0)
    return {"policy": policy, "kept_bytes": kept, "step_s": statistics.median(times)}


def test_recompute_policies(benchmark):
    benchmark.group = "recompute-policies"
    rows = benchmark.pedantic(lambda: [_measure(p) for p in POLICIES], rounds=1, iterations=1)
    base = rows[0]
    print(f"\nLlama stack: {CFG.layers} layers, hidden {CFG.hidden}, batch {BATCH} x {CFG.seq_len}")
    print(f"{'policy':>10} {'kept MiB':>9} {'vs none':>8} {'step ms':>8} {'vs none':>8}")
    for r in rows:
        print(
            f"{r['policy']:>10} {r['kept_bytes'] / 2**20:>9.2f} "
            f"{r['kept_bytes'] / base['kept_bytes']:>8.2f} {r['step_s'] * 1e3:>8.1f} "
            f"{r['step_s'] / base['step_s']:>8.2f}"
        )
    benchmark.extra_info["rows"] = rows
    kept = {r["policy"]: r["kept_bytes"] for r in rows}
    assert kept["full"] < kept["every:2"] < kept["none"]
    assert kept["attention"] < kept["none"] and kept["mlp"] < kept["none"]
