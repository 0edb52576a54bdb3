"""check_parallel and ``python -m fastpar.verify --hf-config``: a user's own model, proven."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.nn.functional as F
from _hf import build, config, readme_plan
from torch import nn

from fastpar import parity
from fastpar.testing import check_parallel

# the module (fastpar.nn re-exports the function under the same name)
parallelize_module = importlib.import_module("fastpar.nn.parallelize")


class _Attention(nn.Module):
    """Heads split over TP, with a per-head RMS scale (a replicated weight on split heads)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.n_head, self.hd = heads, d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, d // heads))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            f(x).view(b, t, self.n_head, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        q = F.rms_norm(q, (self.hd,)) * self.head_scale
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class _TinyLM(nn.Module):
    def __init__(self, vocab=37, d=24, heads=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Attention(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


PLAN = {"emb": "vocab", "blocks.*.[qkv]": "column", "blocks.*.out": "row"}


@pytest.mark.parametrize("zero", [0, 3])
def test_check_parallel_on_a_model_defined_here(zero):
    report = check_parallel(_TinyLM, PLAN, tp=2, dp=2, zero=zero, steps=3)
    assert report.ok, report.text
    assert report.grad_reduced == ["blocks.0.head_scale", "blocks.1.head_scale"]
    assert report.worst_grad.ok and report.worst_grad.error < 1e-5
    assert report.text.endswith("AGREE")


def test_check_parallel_catches_the_qwen3_bug_without_the_fix(monkeypatch):
    # the fix: q_norm / k_norm gradients all-reduced over TP. Remove it: the check must fail,
    # on a gradient, naming a per-head norm (logits and loss still look perfect)
    monkeypatch.setattr(parallelize_module, "all_reduce_grad", lambda p, group: None)
    report = check_parallel(lambda: build("qwen3"), tp=2, dp=1, zero=0, steps=2)
    assert not report.ok and report.text.endswith("DISAGREE")
    assert report.logits.ok and report.loss.ok, report.text
    assert report.worst_grad.what.endswith(("q_norm.weight", "k_norm.weight")), report.text
    assert report.worst_grad.error > 1e-4 and report.worst_grad.ratio > 100


def _write_config(tmp_path, family: str) -> str:
    cfg = config(family)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


def test_verify_hf_config_cli(tmp_path, capsys, monkeypatch):
    path = _write_config(tmp_path, "qwen3")
    assert parity.main(["--hf-config", path, "--tp", "2", "--dp", "2", "--zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "AGREE" in out and "per-head" in out
    monkeypatch.setattr(parallelize_module, "all_reduce_grad", lambda p, group: None)
    assert parity.main(["--hf-config", path, "--tp", "2", "--dp", "1", "--zero", "0"]) == 1
    assert "DISAGREE" in capsys.readouterr().out


def test_verify_hf_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert parity.main(["--hf-config", str(bad)]) == 2
    assert "has no 'model_type'" in capsys.readouterr().err
    path = _write_config(tmp_path, "llama")  # 4 KV heads
    assert parity.main(["--hf-config", path, "--tp", "8", "--dp", "1"]) == 2
    assert "config.num_key_value_heads=4, not divisible" in capsys.readouterr().err


# -- one verdict for every seed ------------------------------------------------------------------
def _qwen3():
    """The tiny Qwen3 drawn under whatever seed check_parallel sets (no seed of its own)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_config(config("qwen3"))


SEEDS = range(10)


def test_the_readme_plan_agrees_for_every_seed():
    """AGREE on 10 seeds out of 10: the verdict is the layout's, not the seed's (a fixed fp32
    tolerance said DISAGREE for some seeds on a correct layout)."""
    plan = readme_plan()
    for seed in SEEDS:
        report = check_parallel(_qwen3, plan, tp=2, dp=2, zero=1, steps=3, seed=seed)
        assert report.ok, f"seed {seed}:\n{report.text}"


def _drop_copy_to_region(x, group=None):
    return x  # the identity forward stays; the backward all-reduce over TP is gone


@pytest.mark.parametrize("bug", ["qk_norm_reduction", "tp_all_reduce"])
def test_a_planted_bug_disagrees_for_every_seed(bug, monkeypatch):
    """DISAGREE on 10 seeds out of 10 for a removed q/k-norm gradient reduction and for a
    dropped TP all-reduce (the input gradient of the column-parallel layers), each on a
    gradient, by far (the rule's bound is not loose enough to hide a defect)."""
    import fastpar.nn.linear

    if bug == "qk_norm_reduction":
        monkeypatch.setattr(parallelize_module, "all_reduce_grad", lambda p, group: None)
    else:
        monkeypatch.setattr(fastpar.nn.linear, "copy_to_region", _drop_copy_to_region)
    plan = readme_plan()
    for seed in SEEDS:
        report = check_parallel(_qwen3, plan, tp=2, dp=1, zero=0, steps=1, seed=seed)
        assert not report.ok and report.text.endswith("DISAGREE"), f"seed {seed}"
        assert not report.worst_grad.ok and report.worst_grad.ratio > 100, report.text
        assert report.logits.ok, report.text  # the forward is right: only gradients show it
