"""LoRA on fastpar's own Llama (its fused q|k|v and gate|up column layers, its o and down row
layers): ``apply_lora(model, "qkv,o,gate_up,down", ...)`` at TP 2, with and without sequence
parallelism, against the same model and adapters in one process: logits, loss and every
adapter gradient on every rank (its part), judged by the tolerance rule against the float64
run (docs/tolerances.md); the base has no gradient.

An adapter on the fused ``qkv`` is one adapter on the fused projection (B's rows split by
blocks like the weight's): the same function as PEFT's on a fused layer, not three adapters on
separate q, k, v projections (tests/test_lora_peft.py covers those on a Hugging Face Llama)."""

from __future__ import annotations

import pytest
import torch
from _mesh import make_mesh
from _model_runs import agree_three, agree_tp_output, three
from _parity import local_part

from fastpar.models import LlamaConfig, build_llama, llama_loss
from fastpar.nn.lora import apply_lora, lora_modules, lora_parameters
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks

R, ALPHA = 4, 8.0
TARGETS = "qkv,o,gate_up,down"


def _lora(model: torch.nn.Module, local) -> list[str]:
    """Adapters on ``model`` (A drawn under seed 3 on every rank), each B set to ``local`` of
    the same full non-zero draw."""
    torch.manual_seed(3)
    names = apply_lora(model, TARGETS, R, ALPHA)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _, m in lora_modules(model):
            full = torch.randn(m.out_features, R, generator=g) / 4
            m.lora_B.copy_(local(full, m.lora_B))
    return names


def _reference(cfg: LlamaConfig):
    """In this (rank-less) process: the model with adapters, a batch, its three runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*build_llama(cfg))
    _lora(model, lambda full, _p: full)
    torch.manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    logits, losses, grads = [], [], []
    for m in three(model):  # fp32, its twin, float64
        out = m(ids)
        value = llama_loss(out, targets, cfg)
        value.backward()
        logits.append(out.detach())
        losses.append(value.detach())
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.requires_grad})
    want = (logits, losses, grads)
    return (ids, targets), want, reduction_length(model, ids)


def _tp(cfg: LlamaConfig, tp: int, batch, want, length) -> int:
    mesh = make_mesh(tp=tp)
    torch.manual_seed(0)
    par = torch.nn.Sequential(*build_llama(cfg, mesh))
    names = _lora(par, local_part)
    kinds = {n.rsplit(".", 1)[-1]: m.kind for n, m in lora_modules(par)}
    assert kinds == {"qkv": "column", "gate_up": "column", "o": "row", "down": "row"}
    ids, targets = batch
    out = agree_tp_output(par(ids), targets, cfg, mesh, llama_loss, want, length, "LoRA")
    out.backward()
    for name, p in lora_parameters(par):
        expect = [local_part(g[name], p) for g in want[2]]
        agree_three(p.grad, expect, f"grad of {name} on TP rank {mesh.tp_rank}", length)
    assert all(p.grad is None for p in par.parameters() if not p.requires_grad)
    return len(names)


@pytest.mark.parametrize("sp", [False, True])
def test_fastpar_llama_lora_at_tp2(sp):
    base = dict(vocab_size=53, seq_len=8, hidden=24, heads=4, kv_heads=2, head_dim=6, ffn=20)
    cfg = LlamaConfig(layers=2, sequence_parallel=sp, **base)
    assert run_ranks(_tp, 2, cfg, 2, *_reference(cfg)) == [4 * 2] * 2
