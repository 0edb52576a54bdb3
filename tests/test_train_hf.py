"""``fastpar.train --hf-config`` and ``fastpar.verify --hf-config``: a Hugging Face model from its
config.json trained through the training command (built-in TP plan, decoder pipeline stages,
every data-parallel wrapper) equals single-process training of the HF model itself; the
checkpoint exports to an HF directory that transformers loads with the trained weights; --plan
FILE for a family without a built-in plan, and its errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _flags import HF_RUN, ONE_RANK, argv, tiny_argv
from _hf import GQA, transformers
from _hf import config as hf_config

from fastpar import checkpoint, tolerance
from fastpar.train import TrainConfig, launch, main
from fastpar.verify import compare, references
from fastpar.verify import main as verify_main

SMALL = dict(HF_RUN, steps=3, ep=1)


def _config_file(tmp_path, family: str, **overrides) -> str:
    path = tmp_path / f"{family}.json"
    cfg = hf_config(family, vocab_size=300, **overrides)  # the byte corpus: ids < 256
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


@pytest.mark.parametrize(
    "family, layout",
    [
        ("qwen3", dict(tp=2, pp=2, dp=2, zero=1)),  # tied embeddings across stages, q/k-norm
        ("llama", dict(tp=2, pp=2, dp=2, zero=0, schedule="gpipe", microbatches=4)),
        ("mixtral", dict(tp=2, pp=2, dp=1, zero=2, recompute=True)),
        ("mixtral", dict(tp=2, pp=1, dp=2, zero=2, ep=2)),  # the experts over the replicas
        ("llama", dict(tp=2, pp=1, dp=2, zero=3)),
        ("gpt2", dict(tp=2, pp=1, dp=2, zero=2)),  # Conv1D, one block
        ("bert", dict(tp=2, pp=1, dp=2, zero=1)),  # masked LM
        ("qwen2", dict(tp=2, pp=2, dp=1, zero=1, precision="bf16")),
    ],
    ids=[
        "qwen3-tp2pp2dp2-z1",
        "llama-gpipe-z0",
        "mixtral-recompute-z2",
        "mixtral-ep2-z2",
        "llama-z3",
        "gpt2",
        "bert-mlm",
        "qwen2-bf16",
    ],
)
def test_training_command_equals_single_process(tmp_path, family, layout):
    cfg = TrainConfig.from_flags(**{**SMALL, **layout, "hf_config": _config_file(tmp_path, family)})
    ok, text = compare(cfg)
    assert ok, text
    assert text.startswith("hf:") and text.endswith("AGREE")


def test_checkpoint_exports_to_a_directory_transformers_loads(tmp_path):
    path = _config_file(tmp_path, "qwen3")
    cfg = TrainConfig.from_flags(**{**SMALL, "tp": 2, "pp": 2, "dp": 2, "hf_config": path})
    refs = references(cfg, None)  # single-process: fp32, its twin, float64
    cfg.checkpoint_dir, cfg.save_every = str(tmp_path / "ckpt"), cfg.steps
    launch(cfg)
    out = str(tmp_path / "hf")
    with open(path) as f:
        config = transformers.AutoConfig.for_model(**json.load(f))
    checkpoint.export_hf(os.path.join(cfg.checkpoint_dir, "step_000003"), out, config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    got = dict(hf.named_parameters())
    assert set(got) == set(refs.exact.params)
    for name in refs.exact.params:  # the distributed run's weights are the reference's
        c = refs.param(name, got[name].detach())
        assert c.ok, c

    def dense(run, dtype):  # transformers' own model on a reference run's weights
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        model = model.to(dtype)
        model.load_state_dict(run.params, strict=False)  # copied into the model's dtype
        model.tie_weights()
        return model

    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ones = [dense(r, torch.float32)(ids).logits for r in (refs.single, refs.twin)]
        exact = dense(refs.exact, torch.float64)(ids).logits
        c = tolerance.compare(hf(ids).logits, ones, exact, length=refs.length, what="logits")
    assert c.ok, c


def test_loss_falls_through_the_cli(tmp_path, capfd):
    path = _config_file(tmp_path, "llama")
    argv = ["--hf-config", path, "--tp", "2", "--pp", "2", "--dp", "1", "--steps", "6"]
    assert main([*argv, "--seq-len", "16", "--batch-size", "4", "--lr", "1e-2"]) == 0
    out = capfd.readouterr().out  # rank 0 prints from its own process
    assert f"fastpar.train: llama (--hf-config {path})" in out and "ep 1" in out
    first, last = (float(x) for x in out.split("done: loss ")[1].split(" over")[0].split(" -> "))
    assert last < first


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ep", "2"], "--ep 2 with --hf-config: a llama model has no MoE block whose experts"),
        (["--model", "llama"], "--model does not apply with --hf-config"),
        (["--tp", "8", "--dp", "1", "--pp", "1"], "--tp 8 does not divide the config's"),
        (["--seq-len", "100"], "--seq-len 100 exceeds the config's 64 positions"),
        (["--vocab-size", "512"], "--vocab-size 512 differs from the config's vocab_size 300"),
        (["--sequence-parallel"], "--sequence-parallel is not supported with --hf-config"),
        # the size flags were ignored: the run trained the config's model
        (["--hidden", "128"], "--hidden does not apply with --hf-config (the config sets"),
        (["--layers", "8"], "--layers does not apply with --hf-config"),
        (["--heads", "8"], "--heads does not apply with --hf-config"),
        (["--rope-theta", "5e5"], "--rope-theta does not apply with --hf-config"),
        (["--experts", "8"], "--experts does not apply with --hf-config"),
        (["--moe-every", "3"], "--moe-every does not apply with --hf-config"),
    ],
)
def test_cli_errors(tmp_path, capsys, extra, message):
    assert main(["--hf-config", _config_file(tmp_path, "llama"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_pipeline_of_a_non_decoder_is_refused(tmp_path, capsys):
    assert main(["--hf-config", _config_file(tmp_path, "gpt2"), "--pp", "2"]) == 2
    assert "pipeline stages split the decoder families" in capsys.readouterr().err


def test_verify_cli_runs_both_checks(tmp_path, capsys):
    path = _config_file(tmp_path, "qwen3")
    assert verify_main(["--hf-config", path, "--tp", "2", "--dp", "2", "--pp", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("AGREE") == 2 and "per-head" in out and "training command:" in out


def test_a_family_without_a_plan_trains_at_tp1_and_is_refused_only_at_tp2(tmp_path, capsys):
    """--hf-config of a family with no built-in plan (Gemma 3): at --tp 1 nothing needs
    splitting, so data parallelism and ZeRO run it (verify AGREE: check_parallel and the
    training command); at --tp 2 it is refused, naming --plan."""
    import json

    from fastpar.train import main as train_main
    from fastpar.verify import main as verify_main

    config = transformers.Gemma3TextConfig(
        **{**GQA, "vocab_size": 256}, max_position_embeddings=64, sliding_window=8
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    small = ["--steps", "2", "--batch-size", "4", "--seq-len", "16", "--pp", "1", "--ep", "1"]
    assert (
        verify_main(["--hf-config", str(path), "--tp", "1", "--dp", "2", "--zero", "1", *small])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("AGREE") >= 2 and "DISAGREE" not in out, out
    assert train_main(["--hf-config", str(path), "--tp", "2", "--dp", "1", *small]) == 2
    err = capsys.readouterr().err
    assert "model_type 'gemma3_text' has no built-in tensor-parallel plan" in err, err
    assert "pass --plan FILE" in err


# -- 4: --plan FILE -------------------------------------------------------------------------------
def _llama_without_plan(tmp_path, monkeypatch):
    """A llama config.json, its family's built-in plan taken away, and that plan as a file."""
    pytest.importorskip("transformers")
    import dataclasses

    from _hf import config as hf_config

    from fastpar import families

    template = families.get("llama").plan
    monkeypatch.setitem(
        families.REGISTRY, "llama", dataclasses.replace(families.get("llama"), plan=None)
    )
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(hf_config("llama", vocab_size=300).to_dict()))
    plan = {k.format(b="model."): ("column" if v == "lm_head" else v) for k, v in template.items()}
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text("".join(f'"{k}" = "{v}"\n' for k, v in plan.items()))
    return str(config), str(plan_file), plan


HF = argv(tp=2, pp=1, dp=1, steps=2, seq_len=16, batch_size=4)


def test_plan_trains_a_family_without_a_built_in_plan(tmp_path, monkeypatch, capfd):
    config, plan_file, _ = _llama_without_plan(tmp_path, monkeypatch)
    assert main(["--hf-config", config, *HF]) == 2
    err = capfd.readouterr().err
    assert "no built-in tensor-parallel plan" in err and "pass --plan FILE" in err, err
    assert main(["--hf-config", config, *HF, "--plan", plan_file]) == 0
    out = capfd.readouterr().out
    assert f"fastpar.train: llama (--hf-config {config})" in out and "--plan" in out
    assert "done: loss" in out


def test_plan_file_errors(tmp_path, monkeypatch, capsys):
    config, _, plan = _llama_without_plan(tmp_path, monkeypatch)
    cases = {
        "missing.json": (None, "cannot read it"),
        "bad.json": ("{", "not valid JSON"),
        "typo.json": (
            json.dumps({**plan, "model.layers.*.self_attn.qproj": "column"}),
            "matches no module of LlamaForCausalLM; the nearest module is",
        ),
        "style.json": (json.dumps({**plan, "lm_head": "diagonal"}), "style must be one of"),
        "head.json": (json.dumps({**plan, "lm_head": "row"}), 'plan it "column"'),
        "plan.yaml": ("", "name a .toml or a .json file"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        assert main(["--hf-config", config, *HF, "--plan", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--plan {path}" in err and message in err, err
    assert main([*tiny_argv(ONE_RANK, steps=1), "--plan", str(tmp_path / "typo.json")]) == 2
    assert "add --hf-config FILE" in capsys.readouterr().err
