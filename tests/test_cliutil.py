"""``fastpar.cliutil``: the parser of every command (no prefix matching; an unknown flag in one
line naming the nearest flag; other parse errors in one line; each command's own help, verify's
refusing the training-only flags), and ``read_table``, the one reader of a command line's .toml
/ .json file (a table, or one line naming the flag, the file and the fix)."""

from __future__ import annotations

import os

import pytest
from _procs import ROOT, run_module

from fastpar.cliutil import Parser, nearest_flag, read_table, unknown_text
from fastpar.train import main


@pytest.mark.parametrize(
    "name, text",
    [
        ("run.toml", 'steps = 7\nname = "a"\n[layout]\ntp = 2\n'),
        ("run.json", '{"steps": 7, "name": "a", "layout": {"tp": 2}}'),
    ],
)
def test_reads_the_table(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert read_table(str(path), "--config") == {"steps": 7, "name": "a", "layout": {"tp": 2}}


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.yaml", "steps: 1\n", "--config {path}: name a .toml or a .json file"),
        ("a.toml", "steps = \n", "--config {path}: cannot read it as TOML (not valid TOML: "),
        ("a.json", "{", "--config {path}: cannot read it as JSON (not valid JSON: "),
        ("a.json", "[1, 2]", "--config {path}: the file must hold a table of flags, not a list"),
        ("a.json", "7", "--config {path}: the file must hold a table of flags, not an int"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_table(str(path), "--config", holds="flags")
    text = str(info.value)
    assert text.startswith(message.format(path=path)) and "\n" not in text, text


def test_a_missing_file_names_the_reason(tmp_path):
    path = tmp_path / "none.toml"
    with pytest.raises(ValueError) as info:
        read_table(str(path), "--plan")
    text = str(info.value)
    assert text == f"--plan {path}: cannot read it as TOML (No such file or directory)", text


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
    r = run_module(module, *argv, timeout=60)
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
    r = run_module("fastpar.verify", "--help", timeout=60)
    assert r.returncode == 0
    out = r.stdout
    assert "Train a GPT" not in out
    assert "ONE process on the whole global batch" in out and "float64" in out
    assert "the tolerance rule" in out and "4 x the" in out
    assert "exit codes:" in out and "0  AGREE" in out and "1  DISAGREE" in out
    steps = out.split("\n  --steps STEPS", 1)[1].split("\n  --", 1)[0]
    assert "(default 3)" in " ".join(steps.split()), steps
    train = run_module("fastpar.train", "--help", timeout=60).stdout
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
    r = run_module(module, "--help", timeout=60)
    assert r.returncode == 0 and "Train a GPT" not in r.stdout
    assert f"python -m {module}" in r.stdout
