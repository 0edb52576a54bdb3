"""The training command's own lines (``fastpar.train.summary``): the header naming what changes
the math, --compile's first step said first, the end-of-run summary and train_config.json, the
note on the default world of a small machine."""

from __future__ import annotations

import json

import pytest
from _flags import ONE_RANK, tiny_argv
from _procs import run_module, run_python

from fastpar.train import TrainConfig
from fastpar.train.summary import (
    default_world_note,
    done_line,
    header_line,
    layout_given,
    math_settings,
)

#: one rank, one step, the log lines on (they are what these tests read)
SMALL = tiny_argv(ONE_RANK, steps=1, quiet=False)


@pytest.mark.slow  # torch.compile on a CPU: about a minute
def test_compile_says_so_first():
    r = run_module("fastpar.train", *SMALL, "--steps", "2", "--compile", timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[1] == "compiling (first step)..." and "compile" in lines[0]
    assert "ETA ?" in lines[2] and "ETA 0:00:00" in lines[3]


# -- 6, 7: the header and the end of a run --------------------------------------------------------
def test_end_of_run_summary_and_settings_file(tmp_path):
    ckpt = tmp_path / "ck"
    r = run_module("fastpar.train", *SMALL, "--checkpoint-dir", str(ckpt), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    done = r.stdout.strip().splitlines()[-1]
    assert done.startswith("done: loss ") and " tok/s; checkpoint " in done, done
    assert done.endswith(f"settings {ckpt / 'train_config.json'}") and len(done) < 300, done
    settings = json.loads((ckpt / "train_config.json").read_text())
    assert settings["steps"] == 1 and settings["checkpoint_dir"] == str(ckpt)
    r = run_module("fastpar.train", *SMALL, timeout=120)
    assert r.stdout.strip().splitlines()[-1].endswith("nothing saved (no --checkpoint-dir)")


def test_done_line():
    cfg = TrainConfig.from_flags(checkpoint_dir="/tmp/x")
    recs = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "run_tokens_per_s": 1234.4}]
    assert done_line(cfg, recs) == (
        "done: loss 5.0000 -> 4.0000 over 2 steps, 1,234 tok/s; checkpoint /tmp/x/step_000002, "
        "settings /tmp/x/train_config.json"
    )


def test_header_names_what_changes_the_math():
    cfg = TrainConfig.from_flags(
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
    plain = math_settings(TrainConfig.from_flags(moe_every=0))
    assert plain == ["token loss normalisation"]


# -- 9: the default world on a small machine ------------------------------------------------------
def test_default_world_note():
    cfg = TrainConfig.from_flags()
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
    r = run_python("-c", code, *flags)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: no layout flags: running the default world of 8 ranks" in r.stderr
    r = run_python("-c", code, *SMALL)
    assert r.returncode == 0 and "note:" not in r.stderr
