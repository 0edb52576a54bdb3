"""``fastpar.optim.Muon`` under tensor and expert parallelism: two steps on each rank's shards
equal, bit for bit, two steps of the single-device Muon on the whole model given the same whole
gradients (each rank's shards cut from them by the test, as the layers cut weights), every
parameter — the gathered matrix goes through the same kernels in the same order. Fused q|k|v
(GPT) and q|k|v grouped by kv head with gate|up (Llama), experts split over TP (each expert's
gate and up apart) and over EP. Orthogonalising each rank's shard instead (the gather removed)
is caught."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh
from _model_runs import MOE_LLAMA
from _parity import local_slice
from torch import nn

from fastpar.mesh.placement import expert_layout, param_layout
from fastpar.models import build_model
from fastpar.models.gpt import GPTConfig
from fastpar.models.llama import LlamaConfig
from fastpar.optim import Muon, muon_param_groups
from fastpar.optim import muon_matrices as mm
from fastpar.testing import run_ranks

CONFIGS = {
    "gpt_tp2": (GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, layers=1), dict(tp=2)),
    "llama_moe_tp2": (
        LlamaConfig(**MOE_LLAMA, num_experts=2, moe_expert_tp=True),
        dict(tp=2),
    ),
    "llama_moe_ep2": (
        LlamaConfig(**MOE_LLAMA),
        dict(ep=2),
    ),
}


def _cut(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole tensor ``full`` of ``p`` (experts, then its TP split)."""
    ex = expert_layout(p)
    if ex is not None and ex.group is not None:
        n = ex.num_experts // dist.get_world_size(ex.group)
        full = full[dist.get_rank(ex.group) * n :][:n]
    layout = param_layout(p)
    if layout is None or layout.kind != "sharded" or layout.group is None:
        return full
    return local_slice(full, p, layout.fused)


def _grads(model: nn.Module, step: int, cut: bool) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        shape = list(p.shape)
        layout, ex = param_layout(p), expert_layout(p)
        if layout is not None and layout.kind == "sharded" and layout.group is not None:
            shape[layout.dim] = layout.full_size
        if ex is not None and ex.group is not None:
            shape[0] = ex.num_experts
        g = torch.randn(shape, generator=gen)
        p.grad = _cut(g, p) if cut else g


def _shard_blocks(p: torch.Tensor, blocks_of=mm.blocks_of):
    """The fault's blocks: the real ones shrunk to this rank's shard (what a careless Muon
    would use on the shard it holds)."""
    blocks, layout = blocks_of(p), param_layout(p)
    if blocks is None or layout is None or layout.kind != "sharded" or layout.group is None:
        return blocks
    dim, sizes, repeat = blocks
    world = dist.get_world_size(layout.group)
    if repeat % world == 0:
        return dim, sizes, repeat // world
    return dim, tuple(n // world for n in sizes), repeat


def _train(model: nn.Module, cut: bool) -> Muon:
    opt = Muon(muon_param_groups(model, weight_decay=0.1), lr=0.02)
    for step in range(2):
        _grads(model, step, cut)
        opt.step()
    return opt


def _single(name: str) -> dict[str, torch.Tensor]:
    """Two steps of the whole model on this process (no process group: one device)."""
    torch.manual_seed(0)
    whole = nn.Sequential(*build_model(CONFIGS[name][0]))
    _train(whole, cut=False)
    return {n: p.detach().clone() for n, p in whole.named_parameters()}


def _parallel(name: str, ref: dict, orthogonalise_shards: bool) -> dict[str, float]:
    """{parameter: max |parallel - single-device cut|} after two Muon steps on the shards."""
    cfg, sizes = CONFIGS[name]
    mesh = make_mesh(**sizes)
    if orthogonalise_shards:  # the planted fault: no gather, each rank's shard on its own
        mm.assemble = lambda update, p, counts=None: update
        mm.local_part = lambda full, p, local: full
        mm.blocks_of = _shard_blocks
    torch.manual_seed(0)
    par = nn.Sequential(*build_model(cfg, mesh))
    opt = _train(par, cut=True)
    out = {n: float((p.detach() - _cut(ref[n], p)).abs().max()) for n, p in par.named_parameters()}
    out["_tp_gather_bytes"] = opt.comm_bytes["tp_gather"]
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_muon_tp_equals_single_device(name):
    for out in run_ranks(_parallel, 2, name, _single(name), False):
        sent = out.pop("_tp_gather_bytes")
        bad = {n: d for n, d in out.items() if d != 0.0}
        assert not bad, f"{name}: parameters off the single-device Muon: {bad}"
        assert (sent > 0) == ("tp" in name)


@pytest.mark.parametrize("name", ["gpt_tp2", "llama_moe_tp2"])
def test_orthogonalising_the_shard_is_caught(name):
    """The same comparison with the gather removed: every TP-split Muon matrix is off by about
    the size of its update, not by a rounding."""
    for out in run_ranks(_parallel, 2, name, _single(name), True):
        out.pop("_tp_gather_bytes")
        split = [n for n in out if n.endswith(("qkv.weight", "gate_up.weight", "mlp.w1"))]
        assert split, out
        for n in split:
            assert out[n] > 1e-4, f"{name}: {n} passed with the shard orthogonalised alone"
