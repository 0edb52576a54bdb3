"""A CLI that helps: no prefix matching in any command, an unknown flag in one line
naming the nearest flag, verify's own help, --plan FILE for an HF family without a built-in
plan, --compile's first step and ETA, the end-of-run summary and train_config.json, the header
naming what changes the math, Kineto's lines on rank 0 only, the default-world note."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _flags import ONE_RANK, argv, tiny_argv

from fastpar.cliutil import Parser, nearest_flag, unknown_text
from fastpar.train import TrainConfig, main
from fastpar.train.metrics import metrics_row
from fastpar.train.summary import (
    default_world_note,
    done_line,
    header_line,
    layout_given,
    math_settings,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: one rank, one step, the log lines on (they are what these tests read)
SMALL = tiny_argv(ONE_RANK, steps=1, quiet=False)


def _run(module: str, *argv: str, timeout: float = 180, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


# -- 1, 2: no prefix matching, one line for an unknown flag -------------------------------------
@pytest.mark.parametrize(
    "module, argv, near",
    [
        ("fastpar.train", ["--microbatch", "4"], "--microbatches"),
        ("fastpar.train", ["--step", "5"], "--steps"),  # a prefix of --steps: not taken
        ("fastpar.verify", ["--step", "5"], "--steps"),
        ("fastpar.mesh", ["--world-size", "4", "--t", "2"], None),
        ("fastpar.mesh", ["--world-size", "4", "--chek"], "--check"),
        ("fastpar.tokenizer", ["--vocab", "300", "--out", "x"], "--vocab-size"),
        ("fastpar.export", ["a", "b", "--chek"], "--check"),
        ("fastpar.checkpoint", ["info", "d", "--jsn"], "--json"),
    ],
)
def test_unknown_flag_is_one_line_with_the_nearest(module, argv, near):
    r = _run(module, *argv, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unrecognized argument"), r.stderr
    if near:
        assert lines[0].endswith(f"did you mean {near}?"), lines[0]


def test_every_parser_refuses_prefixes():
    from fastpar.checkpoint.cli import parser
    from fastpar.train import build_parser
    from fastpar.verify import parser as verify_parser

    for ap in (build_parser(), verify_parser(), parser()):
        assert isinstance(ap, Parser) and ap.allow_abbrev is False
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--step", "5"])
    assert exc.value.code == 2
    src = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(ROOT, "fastpar"))
        for f in fs
        if f.endswith(".py")
    ]
    for path in src:
        with open(path) as f:
            assert "argparse.ArgumentParser(" not in f.read(), path


def test_nearest_flag_and_text():
    opts = ["--steps", "--microbatches", "--seed", "-h"]
    assert nearest_flag("--microbatch=3", opts) == "--microbatches"
    assert nearest_flag("--zzzzzz", opts) is None
    text = unknown_text(["--stepz", "3", "--x"], opts, "prog")
    assert text == "unrecognized argument --stepz (and 1 more); did you mean --steps?"
    assert "see prog --help" in unknown_text(["--qqqqqqq"], opts, "prog")


def test_other_parse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--steps", "many"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "invalid int value: 'many'" in err, err


# -- 3: verify's own help -----------------------------------------------------------------------
def test_verify_has_its_own_help():
    r = _run("fastpar.verify", "--help", timeout=60)
    assert r.returncode == 0
    out = r.stdout
    assert "Train a GPT" not in out
    assert "ONE process on the whole global batch" in out and "float64" in out
    assert "the tolerance rule" in out and "4 x the" in out
    assert "exit codes:" in out and "0  AGREE" in out and "1  DISAGREE" in out
    steps = out.split("\n  --steps STEPS", 1)[1].split("\n  --", 1)[0]
    assert "(default 3)" in " ".join(steps.split()), steps
    train = _run("fastpar.train", "--help", timeout=60).stdout
    assert "(default 30)" in " ".join(train.split("\n  --steps STEPS", 1)[1].split()[:12])


@pytest.mark.parametrize(
    "argv",
    [
        ["--resume", "--checkpoint-dir", "ckpt"],
        ["--checkpoint-dir=ckpt", "--steps", "2"],
        ["--hf-config", "config.json", "--save-every", "1"],
    ],
    ids=["resume", "checkpoint-dir", "hf-save-every"],
)
def test_verify_refuses_the_training_only_flags(argv, capsys):
    """verify trains from scratch in a temporary directory: a checkpoint flag would be ignored
    (it used to end in two tracebacks, exit 1, naming the temporary directory)."""
    from fastpar.verify import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    flag = next(
        a.split("=")[0]
        for a in argv
        if a.split("=")[0] in ("--resume", "--checkpoint-dir", "--save-every")
    )
    assert (
        len(err.splitlines()) == 1
        and f"error: {flag} is a flag of python -m fastpar.train only" in err
    ), err


@pytest.mark.parametrize(
    "module", ["fastpar.export", "fastpar.checkpoint", "fastpar.tokenizer", "fastpar.mesh"]
)
def test_each_command_has_its_own_help(module):
    r = _run(module, "--help", timeout=60)
    assert r.returncode == 0 and "Train a GPT" not in r.stdout
    assert f"python -m {module}" in r.stdout


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
    assert main([*SMALL, "--plan", str(tmp_path / "typo.json")]) == 2
    assert "add --hf-config FILE" in capsys.readouterr().err


# -- 5: --compile ---------------------------------------------------------------------------------
def test_eta_leaves_the_compile_step_out():
    cfg = TrainConfig(steps=10, batch_size=2, seq_len=8)
    import torch

    def row(step, elapsed, **kw):
        rec = {"step": step, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "skipped": False}
        return metrics_row(
            cfg,
            [rec],
            seconds=1.0,
            elapsed=elapsed,
            steps_run=step,
            flops=1.0,
            device=torch.device("cpu"),
            mem=(1.0, None),
            skipped_steps=0,
            **kw,
        )

    assert row(2, 101.0)["eta_s"] == pytest.approx(101.0 / 2 * 8)  # without --compile
    assert row(1, 100.0, compile_s=100.0, compile_steps=1)["eta_s"] is None  # no rate yet
    assert row(2, 101.0, compile_s=100.0, compile_steps=1)["eta_s"] == pytest.approx(8.0)


@pytest.mark.slow  # torch.compile on a CPU: about a minute
def test_compile_says_so_first():
    r = _run("fastpar.train", *SMALL, "--steps", "2", "--compile", timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[1] == "compiling (first step)..." and "compile" in lines[0]
    assert "ETA ?" in lines[2] and "ETA 0:00:00" in lines[3]


# -- 6, 7: the header and the end of a run --------------------------------------------------------
def test_end_of_run_summary_and_settings_file(tmp_path):
    ckpt = tmp_path / "ck"
    r = _run("fastpar.train", *SMALL, "--checkpoint-dir", str(ckpt), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    done = r.stdout.strip().splitlines()[-1]
    assert done.startswith("done: loss ") and " tok/s; checkpoint " in done, done
    assert done.endswith(f"settings {ckpt / 'train_config.json'}") and len(done) < 300, done
    settings = json.loads((ckpt / "train_config.json").read_text())
    assert settings["steps"] == 1 and settings["checkpoint_dir"] == str(ckpt)
    r = _run("fastpar.train", *SMALL, timeout=120)
    assert r.stdout.strip().splitlines()[-1].endswith("nothing saved (no --checkpoint-dir)")


def test_done_line():
    cfg = TrainConfig(checkpoint_dir="/tmp/x")
    recs = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "run_tokens_per_s": 1234.4}]
    assert done_line(cfg, recs) == (
        "done: loss 5.0000 -> 4.0000 over 2 steps, 1,234 tok/s; checkpoint /tmp/x/step_000002, "
        "settings /tmp/x/train_config.json"
    )


def test_header_names_what_changes_the_math():
    cfg = TrainConfig(
        recompute="attention",
        compile=True,
        sequence_parallel=True,
        fused_ce=True,
        loss_normalization="sequence",
        capacity_factor=1.5,
        expert_bias=True,
        z_loss_coef=1e-3,
    )
    line = header_line(cfg, "gloo", 1000, 500)
    for word in (
        "fastpar.train: gpt,",
        "recompute attention",
        "compile",
        "sequence parallel",
        "fused CE",
        "sequence loss normalisation",
        "MoE every 2: top-2 of 4 experts",
        "capacity 1.5",
        "expert bias",
        "z-loss 0.001",
        "1,000 parameters",
    ):
        assert word in line, (word, line)
    plain = math_settings(TrainConfig(moe_every=0))
    assert plain == ["token loss normalisation"]


# -- 8: --profile: Kineto's lines on rank 0 only ------------------------------------------------
@pytest.mark.slow  # two profiled two-rank runs in subprocesses
def test_profiler_lines_only_on_rank_0(tmp_path):
    flags = tiny_argv(ONE_RANK, steps=1, quiet=False, dp=2, batch_size=4, profile=tmp_path / "p")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}

    def kineto_pids(extra: dict) -> set[str]:  # "USDT:<date> <time> <pid>:<tid> File.cpp:52] ..."
        r = _run("fastpar.train", *flags, env={**env, **extra})
        assert r.returncode == 0, r.stderr[-2000:]
        return {ln.split()[2].split(":")[0] for ln in r.stderr.splitlines() if ".cpp:" in ln}

    assert len(kineto_pids({})) <= 1  # rank 0's lines at most
    assert len(kineto_pids({"KINETO_LOG_LEVEL": "0"})) >= 1  # asked for: every rank's
    for rank in (0, 1):
        assert os.path.getsize(tmp_path / "p" / f"trace_rank{rank}.json") > 0


# -- 9: the default world on a small machine ------------------------------------------------------
def test_default_world_note():
    cfg = TrainConfig()
    note = default_world_note(cfg, given=False, cores=2)
    assert note == (
        "note: no layout flags: running the default world of 8 ranks (dp 2 x tp 2 x pp 2) on 2 "
        "CPU cores; pass --dp/--tp/--pp to choose"
    )
    assert default_world_note(cfg, given=True, cores=2) is None
    assert default_world_note(cfg, given=False, cores=8) is None
    assert layout_given(["--tp=1"]) and layout_given([], {"dp": 1}) and not layout_given(["--x"])


def test_default_world_note_through_the_cli():
    code = (
        "import sys, fastpar.train.cli as c; c.cpu_cores = lambda: 2; "
        "sys.exit(c.main(sys.argv[1:]))"
    )
    flags = tiny_argv(steps=1, quiet=False)  # no layout flag
    r = subprocess.run(
        [sys.executable, "-c", code, *flags],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: no layout flags: running the default world of 8 ranks" in r.stderr
    r = subprocess.run(
        [sys.executable, "-c", code, *SMALL],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0 and "note:" not in r.stderr
