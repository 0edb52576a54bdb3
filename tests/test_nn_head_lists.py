"""Per-head module lists sliced with the heads carry a mark (``mark_owned``: this TP rank alone
holds that entry, under its dense name), so everything that reads the marks counts and writes
every head's entry once: StableLM's ``qk_layernorm`` (one LayerNorm per head) at TP 2 gives the
dense model's gradient norm (the whole model's, and the per-head norms' alone); a fastpar
checkpoint saved at TP 2 holds every head's norm and loads at TP 1 and TP 4 bit for bit; a
DCP save and the HF export (``save_hf``) write every head's weights too. Without the mark the
norm counts rank 0's heads only and the checkpoint writes rank 0's entries only.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _hf import stablelm, transformers
from _mesh import make_mesh

from fastpar import parallelize
from fastpar.amp import global_grad_norm
from fastpar.checkpoint import load, save, save_hf
from fastpar.nn import param_layout
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import compare, train_references

VOCAB = 61
_PLAN = {
    "*.self_attn.[qkv]_proj": "column",
    "*.self_attn.o_proj": "row",
    "*.mlp.gate_proj": "column",
    "*.mlp.up_proj": "column",
    "*.mlp.down_proj": "row",
}


def _stablelm(seed: int = 0):
    """A tiny StableLM with one LayerNorm per head (4 heads), every head's norm distinct (at
    init they are all ones: a mix-up of heads would not show)."""
    model = stablelm(VOCAB, seed)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _per_head(name):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _per_head(name: str) -> bool:
    return "layernorm.norms." in name


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(50 + step))


def _loss(model, step, dtype=None) -> torch.Tensor:
    ids = _ids(step)
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _norms() -> list:
    """At TP 2: the whole model's gradient norm, the per-head norms' alone (by the marks), and
    the marks of the per-head norms."""
    mesh = make_mesh(tp=2)
    par = parallelize(_stablelm(), _PLAN, mesh)
    kinds = {
        getattr(param_layout(p), "kind", None) for n, p in par.named_parameters() if _per_head(n)
    }
    _loss(par, 0).backward()
    heads = [p for n, p in par.named_parameters() if _per_head(n)]
    return [
        float(global_grad_norm(par.parameters(), mesh=mesh)),
        float(global_grad_norm(heads, mesh=mesh)),
        kinds,
    ]


def _dense_norm(grads: dict[str, torch.Tensor], which) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for n, g in grads.items() if which(n)))


@pytest.mark.slow  # about 10 s: the three dense references, then TP 2
def test_grad_norm_counts_every_heads_norm_once():
    refs = train_references(_stablelm, _loss, 1, length=reduction_length(_stablelm(), _ids(0)))
    results = run_ranks(_norms, 2)
    assert results[0] == results[1]  # every rank the same norm
    for i, which in enumerate((lambda n: True, _per_head)):
        ones = [_dense_norm(r.grads[0], which) for r in (refs.single, refs.twin)]
        cmp = compare(
            results[0][i], ones, _dense_norm(refs.exact.grads[0], which), length=refs.length
        )
        assert cmp.ok, ("whole model", "per-head norms")[i] + f": {cmp}"
    assert results[0][2] == {"owned"}  # each rank's own entries


def _save(path: str) -> None:
    mesh = make_mesh(tp=2)
    par = parallelize(_stablelm(), _PLAN, mesh)
    save(path, model_params=dict(par.named_parameters()), mesh=mesh, step=1)


def _load_tp4(path: str) -> int:
    """Loaded at TP 4 (one head a rank): every tensor and the logits equal, bit for bit, those
    of the original model parallelized at TP 4 directly."""
    mesh = make_mesh(tp=4)
    direct = parallelize(_stablelm(), _PLAN, mesh)
    loaded = parallelize(_stablelm(seed=1), _PLAN, mesh)
    params = dict(loaded.named_parameters())
    load(path, model_params=params, mesh=mesh)
    want = dict(direct.named_parameters())
    assert params.keys() == want.keys()
    for name, p in params.items():
        assert torch.equal(p, want[name]), name
    with torch.no_grad():
        assert torch.equal(loaded(_ids(3)).logits, direct(_ids(3)).logits)
    return sum(_per_head(n) for n in params)


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("heads") / "ckpt")
    run_ranks(_save, 2, path)
    return path


def test_checkpoint_at_tp2_holds_every_heads_norm_and_loads_at_tp1(tp2_checkpoint):
    original = _stablelm()
    full = dict(original.named_parameters())
    model = _stablelm(seed=1)
    params = dict(model.named_parameters())
    assert not any(torch.equal(params[n], full[n]) for n in params if _per_head(n))
    load(tp2_checkpoint, model_params=params)
    assert sum(_per_head(n) for n in params) == 2 * 2 * 4  # layers x (q, k) x heads
    for name, p in params.items():  # the whole list, every head's entry, bit for bit
        assert torch.equal(p, full[name]), name
    with torch.no_grad():
        assert torch.equal(model(_ids(3)).logits, original(_ids(3)).logits)


@pytest.mark.slow  # 4-5 s alone: four ranks, each parallelizes twice
def test_checkpoint_at_tp2_loads_at_tp4(tp2_checkpoint):
    assert run_ranks(_load_tp4, 4, tp2_checkpoint) == [4, 4, 4, 4]  # layers x (q, k) x 1 head


def _save_hf(path: str) -> None:
    mesh = make_mesh(tp=2)
    par = parallelize(_stablelm(), _PLAN, mesh)
    save_hf(par, path, mesh=mesh)


def _dcp(path: str) -> None:
    from fastpar.checkpoint.dcp import load as dcp_load
    from fastpar.checkpoint.dcp import save as dcp_save

    mesh = make_mesh(tp=2)
    par = parallelize(_stablelm(), _PLAN, mesh)
    dcp_save(dict(par.named_parameters()), path, mesh)
    loaded = parallelize(_stablelm(seed=1), _PLAN, mesh)
    params = dict(loaded.named_parameters())
    dcp_load(params, path, mesh)
    for name, p in par.named_parameters():
        assert torch.equal(params[name], p), name


def _dcp_tp1(path: str) -> int:
    from fastpar.checkpoint.dcp import load as dcp_load

    model, full = _stablelm(seed=1), dict(_stablelm().named_parameters())
    params = dict(model.named_parameters())
    dcp_load(params, path, make_mesh(tp=1))
    for name, p in params.items():
        assert torch.equal(p, full[name]), name
    return sum(_per_head(n) for n in params)


def test_hf_export_and_dcp_write_every_heads_norm(tmp_path):
    out = str(tmp_path / "hf")
    run_ranks(_save_hf, 2, out)
    original = _stablelm()
    exported = transformers.StableLmForCausalLM.from_pretrained(out).float()
    exported.config._attn_implementation = "eager"
    full = dict(original.named_parameters())
    got = dict(exported.named_parameters())
    assert got.keys() == full.keys()
    for name, p in got.items():
        assert torch.equal(p, full[name]), name
    with torch.no_grad():
        assert torch.equal(exported(_ids(3)).logits, original(_ids(3)).logits)
    # DCP: saved at TP 2, reloaded at TP 2 and at TP 1, every head's entry
    path = str(tmp_path / "dcp")
    run_ranks(_dcp, 2, path)
    assert run_ranks(_dcp_tp1, 1, path) == [16]
