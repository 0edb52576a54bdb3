"""``--optimizer muon`` in ``fastpar.train`` and ``fastpar.verify``: the flags, the groups the
trainer builds (the default rule on a pipeline stage), ``fastpar.verify`` AGREEing with its
float64 reference (``ExactMuon``) with expert TP, ZeRO-2 in fp16 and CP (TP, DP / ZeRO 1 and
3, HSDP, PP and EP layouts: tests/test_verify_matrix.py), and catching a Muon that
orthogonalises each rank's shard; a resumed run continues bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _flags import tiny_config, with_hf_config

from fastpar.optim import Muon
from fastpar.optim import muon_matrices as mm
from fastpar.train import TrainConfig, build_parser, launch
from fastpar.train.build import build
from fastpar.verify import compare

SMALL = tiny_config(steps=3, seq_len=32)
MUON = dict(optimizer="muon")


def test_flags_and_groups():
    ns = build_parser().parse_args(["--optimizer", "muon", "--muon-momentum", "0.9"])
    assert (ns.optimizer, ns.muon_momentum) == ("muon", 0.9)
    cfg = TrainConfig.from_flags(
        **{**SMALL, **MUON, "model_type": "llama", "moe_every": 2, "tp": 1, "pp": 1}
    )
    cfg.check()
    parts = build(cfg, None, torch.device("cpu"))
    opt = parts.opt.optimizer
    assert isinstance(opt, Muon) and opt.defaults["momentum"] == 0.95
    names = {id(p): n for n, p in parts.named_parameters().items()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    assert "1.attn.qkv.weight" in muon and "2.mlp.w1" in muon
    assert not {n for n in muon if "tok" in n or "router" in n or "norm" in n}
    exact = build(cfg, None, torch.device("cpu"), exact=True).opt
    assert type(exact).__name__ == "ExactMuon"


def _shard_alone(update, p, counts=None):
    return update


TP2 = dict(tp=2, pp=1, dp=1, ep=1, zero=0)
# the layouts with expert TP at ep 1, ZeRO-2 in fp16 and cp 2 (TP, DP / ZeRO 1 and 3, HSDP, PP,
# EP and MTP: tests/test_verify_matrix.py's muon cases)
LAYOUTS = {
    "gpt-expert-tp2": dict(tp=2, pp=1, dp=1, ep=1, zero=0, moe_every=1, moe_expert_tp=True),
    "dp2-zero2-fp16": dict(tp=1, pp=1, dp=2, ep=1, zero=2, precision="fp16"),
    "cp2": dict(tp=1, pp=1, dp=1, ep=1, zero=0, cp=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verify_agrees(name):
    cfg = TrainConfig.from_flags(**{**SMALL, "moe_every": 0, **LAYOUTS[name], **MUON})
    ok, text = compare(cfg)
    assert ok, text


@pytest.mark.slow
def test_verify_catches_orthogonalising_the_shard(monkeypatch):
    """The ranks fork from here: without the gather each TP rank orthogonalises its own rows of
    q|k|v, fc, proj; the single-process reference holds whole matrices and is not affected."""
    monkeypatch.setattr(mm, "assemble", _shard_alone)
    monkeypatch.setattr(mm, "local_part", lambda full, p, local: full)
    monkeypatch.setattr(mm, "blocks_of", lambda p: None)
    cfg = TrainConfig.from_flags(**{**SMALL, "moe_every": 0, **TP2, **MUON})
    ok, text = compare(cfg)
    assert not ok and "DISAGREE" in text, text


def test_adamw_run_is_unchanged():
    """--optimizer adamw still builds FusedAdamW (the default)."""
    cfg = TrainConfig.from_flags(**{**SMALL, "tp": 1, "pp": 1})
    assert dataclasses.replace(cfg).optimizer.name == "adamw"
    assert type(build(cfg, None, torch.device("cpu")).opt.optimizer).__name__ == "FusedAdamW"


RESUME = dict(SMALL, steps=4, moe_every=0, tp=1, pp=1, dp=2, ep=1, zero=1, **MUON)


def _resume(tmp_path, saved: dict, layout: dict) -> tuple[list[float], list[float]]:
    """(the uninterrupted run's losses, a run saved after step 2 and resumed at ``layout``)."""
    full = [r["loss"] for r in launch(TrainConfig.from_flags(**{**RESUME, **saved}))]
    ckpt = str(tmp_path / "ckpt")
    launch(
        TrainConfig.from_flags(
            **{**RESUME, **saved, "steps": 2, "checkpoint_dir": ckpt, "save_every": 2}
        )
    )
    records = launch(
        TrainConfig.from_flags(**{**RESUME, **layout, "checkpoint_dir": ckpt, "resume": True})
    )
    assert [r["step"] for r in records] == [3, 4]
    return full, [r["loss"] for r in records]


def test_resume_is_bit_identical(tmp_path):
    """Muon's momentum buffers (and AdamW's moments) come back exactly: steps 3 and 4 of a run
    resumed after step 2 are the uninterrupted run's, bit for bit (ZeRO-1 at dp 2)."""
    full, resumed = _resume(tmp_path, {}, {})
    assert resumed == full[2:]


@pytest.mark.slow
def test_resume_reshards_zero1_to_zero3_and_tp2(tmp_path):
    """Saved at ZeRO-1 dp 2, resumed at ZeRO-3 dp 2: the first resumed step's loss is the
    uninterrupted run's bit for bit (the same weights, the same forward); at tp 2 dp 2 it agrees
    to rounding, and so does the step after (the momentum was resharded, not reset)."""
    full, zero3 = _resume(tmp_path / "a", {}, {"zero": 3})
    assert zero3[0] == full[2] and zero3[1] == pytest.approx(full[3], rel=1e-5)
    full, tp2 = _resume(tmp_path / "b", {}, {"tp": 2, "dp": 2})
    assert tp2 == pytest.approx(full[2:], rel=1e-5)


def _hf_file(tmp_path, family: str) -> str:
    import json

    from _hf import config as hf_config

    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(hf_config(family, vocab_size=300).to_dict()))
    return str(path)


@pytest.mark.parametrize("family, what", [("mixtral", "experts"), ("gpt2", "fused weights")])
def test_hf_families_muon_cannot_tell_apart_are_refused(tmp_path, family, what):
    pytest.importorskip("transformers")
    cfg = TrainConfig.from_flags(
        **with_hf_config({**SMALL, **MUON, "tp": 1, "pp": 1}, _hf_file(tmp_path, family))
    )
    with pytest.raises(ValueError, match=f"--optimizer muon with --hf-config {family}: its {what}"):
        build(cfg, None, torch.device("cpu"))


@pytest.mark.slow
def test_verify_agrees_on_an_hf_model(tmp_path):
    """Qwen3 (separate q/k/v projections, q/k norms, tied embeddings across stages)."""
    pytest.importorskip("transformers")
    layout = dict(tp=2, pp=2, dp=2, ep=1, zero=1, seq_len=16)
    cfg = TrainConfig.from_flags(
        **with_hf_config({**SMALL, **MUON, **layout}, _hf_file(tmp_path, "qwen3"))
    )
    ok, text = compare(cfg)
    assert ok, text


@pytest.mark.slow
def test_resume_refuses_another_optimizer_and_warns_on_momentum(tmp_path, capfd):
    ckpt = str(tmp_path / "ckpt")
    base = {**RESUME, "steps": 2, "checkpoint_dir": ckpt, "save_every": 2}
    launch(TrainConfig.from_flags(**base))
    with pytest.raises(Exception, match="--optimizer muon -> adamw"):
        launch(TrainConfig.from_flags(**{**base, "steps": 3, "resume": True, "optimizer": "adamw"}))
    launch(
        TrainConfig.from_flags(
            **{**base, "steps": 3, "resume": True, "muon_momentum": 0.9, "quiet": False}
        )
    )
    assert "--muon-momentum 0.95 -> 0.9" in capfd.readouterr().err
