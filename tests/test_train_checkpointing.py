"""A resume under a changed learning-rate schedule (``fastpar.train.checkpointing``): refused
unless --allow-schedule-change, naming the flag and the LRs of the next two steps; a change the
LR never sees resumes with a note; --data-dtype recorded resolved; ``compare_schedule`` and
``compare_settings`` on their own."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from _checkpoint_runs import SMALL, losses, run, steps

from fastpar.testing import RankError
from fastpar.train import TrainConfig, lr_at

#: past the warm-up from step 1 on, so that --steps moves the cosine schedule
COSINE = dict(warmup=1)


@pytest.fixture(scope="module")
def run_cos(tmp_path_factory):
    """A cosine run of 4 steps, warm-up 1: its checkpoint of step 2 only."""
    root = tmp_path_factory.mktemp("run_cos") / "ckpt"
    run(checkpoint_dir=str(root), **COSINE)
    shutil.rmtree(root / "step_000004")  # interrupted after step 2
    return str(root)


def _rates(old: dict, new: dict, step: int) -> str:
    """The message's LRs of the two steps after ``step``, from ``lr_at`` of both settings."""
    was, now = (
        TrainConfig.from_flags(**{**SMALL, **old}),
        TrainConfig.from_flags(**{**SMALL, **new}),
    )
    return (
        f"LR at step {step + 1}: {lr_at(was, step):.6g} -> {lr_at(now, step):.6g}, at step "
        f"{step + 2}: {lr_at(was, step + 1):.6g} -> {lr_at(now, step + 1):.6g} (saved -> new)"
    )


@pytest.mark.parametrize("change", [dict(steps=8), dict(lr=1e-3)], ids=["steps", "lr"])
def test_a_changed_schedule_is_refused_unless_allowed(run_cos, change, tmp_path, capfd):
    d = str(tmp_path / "ckpt")
    shutil.copytree(run_cos, d)
    new = {**COSINE, **change}
    ((name, value),) = change.items()
    flag = f"--{name} {getattr(TrainConfig.from_flags(**SMALL), name)} -> {value}"
    rates = _rates(COSINE, new, 2)
    was, now = (
        TrainConfig.from_flags(**{**SMALL, **COSINE}),
        TrainConfig.from_flags(**{**SMALL, **new}),
    )
    assert lr_at(was, 2) != lr_at(now, 2)  # the jump the message names
    with pytest.raises(RankError) as err:
        run(checkpoint_dir=d, resume=True, **new)
    text = str(err.value.exception)
    assert f"{d}/step_000002 changes the LR schedule ({flag}): {rates}" in text, text
    assert "resume with the saved values, or pass --allow-schedule-change" in text, text
    assert "changed settings" not in capfd.readouterr().err  # said once, not as a warning too
    resumed = run(checkpoint_dir=d, resume=True, allow_schedule_change=True, **new)
    assert steps(resumed) == list(range(3, now.steps + 1))
    assert [r["lr"] for r in resumed] == [lr_at(now, s) for s in range(2, now.steps)]
    err = capfd.readouterr().err
    assert (
        f"warning: --resume from {d}/step_000002 changes the LR schedule ({flag}): {rates}; "
        "training on with the new schedule (--allow-schedule-change)"
    ) in err, err
    assert "changed settings" not in err


def test_a_schedule_change_the_lr_never_sees_resumes_with_a_note(tmp_path, capfd):
    """Constant past the warm-up: more --steps change no step's LR, so need no flag; the
    resumed run equals an uninterrupted one of the new length."""
    flat = dict(warmup=1, lr_schedule="constant")
    d = str(tmp_path / "ckpt")
    run(checkpoint_dir=d, **flat)
    capfd.readouterr()
    resumed = run(checkpoint_dir=d, resume=True, steps=6, quiet=False, **flat)
    out, err = capfd.readouterr()
    assert steps(resumed) == [5, 6]
    assert (
        f"note: --resume from {d}/step_000004: --steps 4 -> 6 leaves the LR of every step "
        "both settings train unchanged; the run now ends at step 6"
    ) in out, out
    assert out.count("note:") == 1 and "warning" not in err, err
    straight = run(steps=6, save_every=0, **flat)
    assert losses(resumed) == losses(straight)[4:]


def test_a_bin_runs_data_dtype_is_recorded_resolved_and_resumes_quietly(tmp_path, capfd):
    """--data-dtype left out is recorded as the uint16 it resolves to: a resume that leaves
    it out again (or a checkpoint of before, which recorded "uint16") changes no setting."""
    import numpy as np

    ids = tmp_path / "ids.bin"
    (np.arange(5000, dtype=np.uint16) % 512).tofile(ids)
    d = str(tmp_path / "ckpt")
    run(checkpoint_dir=d, data=str(ids), vocab_size=512, steps=2)
    with open(os.path.join(d, "step_000002", "train_config.json")) as f:
        assert json.load(f)["data_dtype"] == "uint16"
    capfd.readouterr()
    assert steps(run(checkpoint_dir=d, data=str(ids), vocab_size=512, steps=3, resume=True)) == [3]
    assert "changed settings" not in capfd.readouterr().err


def test_compare_schedule_and_data_dtype_records():
    """The steps both settings train decide; --data-dtype is compared for a .bin file only
    (a text run recorded "uint16" before it was left unset)."""
    from fastpar.train.checkpointing import compare_schedule, compare_settings

    saved = {"config": TrainConfig.from_flags(**{**SMALL, "warmup": 5, "steps": 10}).flags()}
    assert (
        compare_schedule(saved, TrainConfig.from_flags(**{**SMALL, "warmup": 5, "steps": 10}), 2)
        is None
    )
    # in the warm-up, whose rates --steps does not move: steps 2..3 of both runs
    assert (
        compare_schedule(saved, TrainConfig.from_flags(**{**SMALL, "warmup": 5, "steps": 4}), 2)[2]
        is False
    )
    assert compare_schedule(
        saved, TrainConfig.from_flags(**{**SMALL, "warmup": 5, "steps": 12}), 8
    )[2]
    saved["config"]["data_dtype"] = "uint16"
    assert compare_settings(saved, TrainConfig.from_flags(**SMALL)) == ([], [])
    bin_cfg = TrainConfig.from_flags(**SMALL, data="ids.bin", data_dtype="uint32")
    assert compare_settings(saved, bin_cfg)[1] == [
        "--data None -> ids.bin",
        "--data-dtype uint16 -> uint32",
    ]
