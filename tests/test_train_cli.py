"""The training command's flags: every flag has help text and shows its allowed words, no raw
reST, the differences from Megatron / torchtitan stated; ``--config FILE`` (TOML, JSON) with the
command line overriding it, unknown keys and wrong types refused by name; the resolved config
saved beside each checkpoint, itself a --config file."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from _flags import ONE_RANK, tiny_argv
from _no_ranks import forbid_ranks

from fastpar.checkpoint import verify
from fastpar.train import TrainConfig, build_parser, config_from, launch, main
from fastpar.train.config import flag_specs


def _parse(argv) -> TrainConfig:
    return config_from(build_parser().parse_args(argv))


def test_every_flag_has_help_and_words_are_listed():
    ap = build_parser()
    actions = {a.dest: a for a in ap._actions}
    for spec in flag_specs():
        action = actions[spec.name]
        assert action.help and len(action.help) > 10, spec.name
    text = ap.format_help()
    for shown in (
        "{gpt,llama,deepseek}",
        "{stop,continue}",
        "{fp32,bf16,fp16,fp8}",
        "{tensorwise,rowwise,blockwise}",
        "{0,1,2,3}",
        "{gpipe,1f1b,interleaved,zb-h1}",
        "{cosine,constant}",
        "{rmsnorm,layernorm}",
        "{uint16,uint32}",
    ):
        assert shown in text, shown
    for markup in ("``", ":class:", ":func:", ":mod:", ".. "):
        assert markup not in text, markup
    assert "GLOBAL batch in sequences" in text and "Megatron" in text and "torchtitan" in text
    assert "a COUNT of micro-batches" in text


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--metrics-file FILE" in out
    checkpoints = out.split("checkpoints:", 1)[1].split("\n\n", 1)[0]
    assert "--allow-schedule-change" in checkpoints
    assert _parse([]).data_dtype is None and _parse([]).allow_schedule_change is False


def test_toml_config_and_command_line_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "llama"\nsteps = 7\nlr = 1\nrecompute = true\nbatch-size = 32\n'
        "[layout]\ntp = 1\nzero = 2\n"
    )
    cfg = _parse(["--config", str(path), "--lr", "0.02", "--no-recompute"])
    assert (cfg.model_type, cfg.steps, cfg.batch_size, cfg.tp, cfg.zero) == ("llama", 7, 32, 1, 2)
    assert cfg.lr == 0.02 and cfg.recompute is False  # the command line wins
    assert isinstance(_parse(["--config", str(path)]).lr, float)  # TOML's 1 is the float 1.0
    # before or after --config, a flag given wins
    assert _parse(["--steps", "3", f"--config={path}"]).steps == 3
    assert (
        cfg.model.seq_len == TrainConfig.from_flags().model.seq_len
    )  # neither the file nor the flags: the default


def test_json_config(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"hidden": 48, "heads": 6, "min_lr": None, "qk_norm": False}))
    cfg = _parse(["--config", str(path), "--heads", "4"])
    assert (cfg.model.hidden, cfg.model.heads, cfg.min_lr) == (48, 4, None)


@pytest.mark.parametrize(
    "name,text,message",
    [
        (
            "a.toml",
            "batch_sise = 8\n",
            "unknown key 'batch_sise': did you mean batch_size (--batch-size)?",
        ),
        (
            "a.json",
            '{"micro_batches": 2}',
            "unknown key 'micro_batches': did you mean microbatches (--microbatches)?",
        ),
        ("a.toml", "zzz = 1\n", "unknown key 'zzz': the keys are the flags' names"),
        ("a.toml", 'steps = "7"\n', "steps = '7' must be int"),
        ("a.toml", "recompute = 1\n", "recompute = 1 must be bool"),
        ("a.json", '{"steps": null}', "steps = None must be int"),
        ("a.toml", "steps = \n", "cannot read it as TOML"),
        ("a.yaml", "steps: 1\n", "name a .toml or a .json file"),
    ],
)
def test_bad_config_files_are_one_line(tmp_path, capsys, monkeypatch, name, text, message):
    forbid_ranks(monkeypatch)
    path = tmp_path / name
    path.write_text(text)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --config {path}"), err
    assert message in err, err


def test_a_missing_config_file_is_named(tmp_path, capsys, monkeypatch):
    forbid_ranks(monkeypatch)
    assert main(["--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot read it as TOML" in capsys.readouterr().err


def test_resolved_config_beside_each_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = tiny_argv(ONE_RANK, save_every=1, checkpoint_dir=ckpt)
    cfg = _parse(argv)
    launch(cfg)
    for step in (1, 2):
        step_dir = ckpt / f"step_{step:06d}"
        saved = json.loads((step_dir / "train_config.json").read_text())
        assert saved == cfg.flags()
        verify(step_dir)  # the extra file leaves the checkpoint intact
    # the file is itself a --config: the same run, with flags on top
    again = _parse(["--config", str(ckpt / "step_000002" / "train_config.json"), "--steps", "5"])
    assert again.flags() == {**cfg.flags(), "steps": 5}
    assert not [n for n in os.listdir(ckpt / "step_000002") if ".tmp" in n]


def test_parser_is_an_argparse_parser():
    assert isinstance(build_parser(), argparse.ArgumentParser)
