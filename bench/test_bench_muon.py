"""``fastpar.optim.Muon`` against ``FusedAdamW`` on CPU ranks (gloo), side by side: the
optimizer step's median time (after the same backward) on a small GPT, per layout, with the
bytes Muon sends per step per rank beside the formula, and the owner ranks' load balance.

Formulas (ring collectives, fp32, docs/muon.md): a TP-split Muon matrix of M elements costs
each TP rank (t-1)/t · 4M bytes (one all-gather of the update; the result is sliced locally);
a flat data-parallel shard group of Ψ padded elements costs 2 (N-1)/N · 4Ψ (the update
all-gathered, the results reduce-scattered) plus the TP gathers of the matrices this rank owns.
AdamW sends nothing. The load is the Newton–Schulz cost (∝ A·B·min(A, B)) each rank owns: max
over mean, 1 = balanced. CPU absolute times are noise: the ratio Muon / AdamW is the result.
Run:  pytest bench/test_bench_muon.py -s --benchmark-json=...
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastpar import ParallelMesh
from fastpar.mesh.placement import param_layout
from fastpar.models import build_model
from fastpar.models.gpt import GPTConfig
from fastpar.models.llama import LlamaConfig
from fastpar.optim import FusedAdamW, Muon, muon_param_groups
from fastpar.parallel import Shard
from fastpar.testing import run_ranks

ITERS = 4
CFG = GPTConfig(vocab_size=256, seq_len=32, hidden=128, heads=4, layers=2)
LLAMA = LlamaConfig(
    vocab_size=256, seq_len=32, hidden=128, heads=4, kv_heads=2, layers=3, moe_every=2
)
LAYOUTS = {
    "tp2": dict(tp=2, zero=None, world=2),
    "dp2-zero1": dict(tp=1, zero=1, world=2),
    "dp2-zero3": dict(tp=1, zero=3, world=2),
    "tp2-dp2-zero1": dict(tp=2, zero=1, world=4),
    "llama-moe-dp4-zero3": dict(tp=1, zero=3, world=4, cfg=LLAMA),
}


def _formula(model: nn.Module, groups: list[dict], tp: int, dp: int, zero) -> float:
    """Bytes a rank sends per Muon step on average over the DP ranks (module docstring)."""
    tp_bytes = 0.0
    for p in (p for g in groups if g["muon"] for p in g["params"]):
        layout = param_layout(p)
        if tp > 1 and layout is not None and layout.kind == "sharded":
            tp_bytes += (tp - 1) / tp * 4 * p.numel() * tp
    if zero is None or dp == 1:
        return tp_bytes
    return tp_bytes / dp  # each matrix on one owner of dp; the flats' part is added by caller


def _run(name: str) -> dict:
    spec = LAYOUTS[name]
    tp, zero = spec["tp"], spec["zero"]
    mesh = ParallelMesh(tp=tp)
    dp = dist.get_world_size() // tp
    cfg = spec.get("cfg", CFG)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=torch.Generator())
    out: dict = {"seconds": {}}
    for kind in ("muon", "adamw"):
        torch.manual_seed(0)
        model = nn.Sequential(*build_model(cfg, mesh))
        groups = muon_param_groups(model, weight_decay=0.1)
        if kind == "adamw":
            groups = [{k: v for k, v in g.items() if k != "muon"} for g in groups]
            make = lambda gs: FusedAdamW(gs, lr=1e-3)  # noqa: E731
        else:
            make = lambda gs: Muon(gs, lr=1e-3)  # noqa: E731
        if zero is None:
            opt = make(groups)
            fwd, step, inner = model, opt.step, opt
        else:
            unit = {"wrap": (type(model[1]),)} if zero == 3 else {}
            wrapper = Shard(model, make, stage=zero, mesh=mesh, param_groups=groups, **unit)
            fwd, step, inner = wrapper, wrapper.step, wrapper.optimizer
        times, sent = [], 0.0
        for it in range(ITERS + 1):
            fwd(ids).float().square().mean().backward()
            before = dict(getattr(inner, "comm_bytes", {}))
            t0 = time.perf_counter()
            step()
            if it:
                times.append(time.perf_counter() - t0)
            after = getattr(inner, "comm_bytes", {})
            sent = sum(after.values()) - sum(before.values())
            (wrapper.zero_grad if zero is not None else opt.zero_grad)()
        out["seconds"][kind] = statistics.median(times)
        if kind == "muon":
            out["sent"] = sent
            out["formula"] = _formula(model, groups, tp, dp, zero)
            if zero is not None and dp > 1:
                ids_ = {id(m) for m in _muon_masters(inner)}
                padded = sum(f.padded for f in wrapper.flats if id(f.master) in ids_)
                out["formula"] += 2 * (dp - 1) / dp * 4 * padded
            loads = inner.owner_load()
            out["loads"] = [[round(x / max(sum(g), 1), 3) for x in g] for g in loads]
            out["balance"] = max((max(x) / (sum(x) / len(x)) for x in loads if sum(x)), default=1)
    return out


def _muon_masters(opt) -> list:
    return [p for g in opt.param_groups if g["muon"] for p in g["params"]]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_step(benchmark, name):
    world = LAYOUTS[name]["world"]
    benchmark.group = f"muon-{name}"
    res = benchmark.pedantic(run_ranks, args=(_run, world, name), rounds=1, iterations=1)
    t = {k: statistics.median(r["seconds"][k] for r in res) for k in ("muon", "adamw")}
    sent = [r["sent"] for r in res]
    formula = statistics.mean(r["formula"] for r in res)
    balance = max(r["balance"] for r in res)
    benchmark.extra_info.update(
        seconds=t,
        muon_over_adamw=t["muon"] / t["adamw"],
        sent_bytes_per_rank=sent,
        formula_bytes_per_rank=formula,
        owner_balance_max_over_mean=balance,
        owner_shares=res[0]["loads"],
    )
    assert statistics.mean(sent) == pytest.approx(formula)
    print(
        f"\n{name} (world {world}): step muon {t['muon'] * 1e3:.1f} ms vs adamw "
        f"{t['adamw'] * 1e3:.1f} ms (x{t['muon'] / t['adamw']:.1f}); sent/rank "
        f"{[round(s / 2**10, 1) for s in sent]} KiB, formula (mean) {formula / 2**10:.1f} KiB; "
        f"owner load max/mean {balance:.2f} (shares per group {res[0]['loads']})"
    )
