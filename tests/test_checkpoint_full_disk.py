"""A full disk under a training run, for real: the checkpoint directory is a small tmpfs
(``_disk.small_disk``) that a ballast file fills (``_disk.fill``), never a monkeypatched
``OSError``. A save that meets it ends the run with one line on every rank (or, with
``--on-save-error continue``, trains on and saves once there is room again), keeps the previous
checkpoint, and leaves nothing half-written; whatever else writes there degrades with one
warning: the flight recorder's ring file (its blocks reserved up front: a memory-mapped page
the disk cannot back was a SIGBUS on every rank), the metrics JSONL, TensorBoard, the run's
settings. No rank dies of a signal and nothing prints a traceback.

When the disk fills is chosen by wrapping, in the parent the ranks fork from, the step's save
(``fastpar.train.loop._save``) or ``fastpar.checkpoint.save``: rank 0 fills the disk right
after it; the next save's first collective keeps every rank from writing before that."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch.distributed as dist
from _disk import fill
from _flags import ONE_RANK, tiny_config

from fastpar import checkpoint
from fastpar.checkpoint import CheckpointError
from fastpar.checkpoint.directory import scan
from fastpar.flight.record import RING, SLOT
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, launch
from fastpar.train.checkpointing import SaveFailed

MiB = 2**20
SMALL = tiny_config(
    ONE_RANK,
    steps=4,
    save_every=2,
    batch_size=4,
    dp=2,
    microbatches=1,
    collective_timeout=30,  # a rank left alone in a collective fails the test within that
)
#: what a rank that died or a writer that broke would leave on stderr
BROKEN = ("Traceback", "Fatal Python error", "Bus error", "SIGBUS", "Exception in thread")


def _run(**overrides) -> list[dict]:
    return launch(TrainConfig.from_flags(**{**SMALL, **overrides}))


def _usage(path: str) -> int:
    """Bytes the files under ``path`` take on their filesystem (whole blocks)."""
    return sum(
        os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files
    )


def _on_rank0_after(monkeypatch, module, name: str, actions: dict) -> None:
    """Rank 0 calls ``actions[step]()`` once ``module.name(...)`` of that step returned."""
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        step = kwargs["step"] if "step" in kwargs else args[2]
        if step in actions and dist.get_rank() == 0:
            actions[step]()
        return out

    monkeypatch.setattr(module, name, wrapped)


def _after_save(monkeypatch, actions: dict) -> None:
    """``actions[step]()`` on rank 0 right after the training loop's save of ``step``."""
    from fastpar.train import loop

    _on_rank0_after(monkeypatch, loop, "_save", actions)


def _quiet(err: str) -> None:
    for word in BROKEN:
        assert word not in err, err[-3000:]


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    small_disk, monkeypatch, capfd
):
    disk = small_disk(4 * MiB)
    d = os.path.join(disk, "ckpt")
    step2 = os.path.join(d, "step_000002")
    _after_save(monkeypatch, {2: lambda: fill(disk, leave=_usage(step2) // 2)})
    with pytest.raises(SaveFailed) as info:
        _run(checkpoint_dir=d)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"saving step 4 to {d}/step_000004 failed: "), text
    # a real full disk fails on whichever rank writes last: the line names the file and the rank
    assert re.search(
        rf"No space left on device \(ENOSPC\) writing {re.escape(d)}/step_000004\.partial/"
        r"\S+ on rank \d; ",
        text,
    ), text
    assert re.search(r"needs about [0-9.]+ MiB, [0-9.]+ MiB are free on ", text), text
    assert text.endswith(f"the previous checkpoint {step2} is kept"), text
    # no .partial, no temporary file (flight/: the run's flight records)
    assert sorted(os.listdir(d)) == ["LOCK", "flight", "step_000002", "train_config.json"]
    assert checkpoint.verify(step2)
    _quiet(capfd.readouterr().err)


def test_on_save_error_continue_trains_on_and_saves_at_the_next_save(
    small_disk, monkeypatch, capfd
):
    """The disk fills after step 2 and gets its room back after the failed save of step 4 (the
    operator removed something): the run trains on and saves step 6."""
    disk = small_disk(4 * MiB)
    d = os.path.join(disk, "ckpt")
    ballast = []
    step2 = os.path.join(d, "step_000002")
    _after_save(
        monkeypatch,
        {
            2: lambda: ballast.append(fill(disk, leave=_usage(step2) // 2)),
            4: lambda: os.remove(os.path.join(disk, "ballast")),
        },
    )
    records = _run(checkpoint_dir=d, steps=6, on_save_error="continue")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert sorted(e.step for e in scan(d) if e.status == "complete") == [2, 6]
    assert checkpoint.verify(os.path.join(d, "step_000006"))
    err = capfd.readouterr().err
    assert err.count(f"warning: saving step 4 to {d}/step_000004 failed: ") == 1, err  # once
    assert "No space left on device (ENOSPC)" in err
    assert "training on (--on-save-error continue), the next save retries" in err
    _quiet(err)


def test_a_full_disk_under_the_flight_recorder_metrics_and_tensorboard_is_still_one_line(
    small_disk, monkeypatch, capfd
):
    """TP ranks (fastpar's comm layer notes every collective in the flight recorder's ring)
    with --metrics-file and --tensorboard on the same disk, which fills up completely after the
    save of step 16: steps 17-32 write ring entries, metrics rows and scalars onto a full disk
    (each file doubles, past a block: each needs new blocks), then the save of step 32 fails."""
    pytest.importorskip("tensorboard")
    disk = small_disk(4 * MiB)
    d, rows, tb = (os.path.join(disk, n) for n in ("ckpt", "m.jsonl", "tb"))
    _after_save(monkeypatch, {16: lambda: fill(disk, leave=0)})
    with pytest.raises(SaveFailed) as info:  # not RankError: no rank died of SIGBUS
        outputs = dict(log_every=1, metrics_file=rows, tensorboard=tb)
        _run(checkpoint_dir=d, steps=32, save_every=16, tp=2, dp=1, **outputs)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"saving step 32 to {d}/step_000032 failed: "), text
    assert text.endswith(f"the previous checkpoint {d}/step_000016 is kept"), text
    err = capfd.readouterr().err
    _quiet(err)
    for flag, path in (("--metrics-file", rows), ("--tensorboard", tb)):
        assert re.search(
            rf"^warning: {flag} {re.escape(path)}: No space left on device \(ENOSPC\); .*"
            r"\(the run goes on\)$",
            err,
            re.M,
        ), err
        assert err.count(f"warning: {flag}") == 1, err  # once
    with open(rows) as f:  # whole lines only: the rows that fit, from the first on
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, len(steps) + 1)) and 16 <= len(steps) < 32, steps
    for r in range(2):  # the rings' blocks were reserved before the disk filled
        ring = os.path.join(d, "flight", f"ring_rank{r}.bin")
        assert os.stat(ring).st_blocks * 512 >= RING * SLOT
    assert checkpoint.verify(os.path.join(d, "step_000016"))


def _refused(cfg, tokens) -> str | None:
    """A rank of ``launch``'s: its one-line refusal (None if it trained)."""
    from fastpar.train.loop import run

    try:
        run(cfg, tokens)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_disk_full_before_the_first_step_is_one_line_on_every_rank(small_disk, capfd):
    """One block free: the ring files cannot be reserved (each rank keeps its ring in memory
    and says so), the lock takes the block, and the run's settings file does not fit: every
    rank raises the same line, before the first step."""
    from fastpar.train.batches import load_data

    d = small_disk(4096)
    cfg = TrainConfig.from_flags(**{**SMALL, "checkpoint_dir": d})
    texts = run_ranks(_refused, 2, cfg, load_data(cfg), flight_dir=os.path.join(d, "flight"))
    assert texts == 2 * [
        f"--checkpoint-dir {d}: {d}/train_config.json: No space left on device (ENOSPC) "
        "(0.0 MiB are free there): free some space, or pass another --checkpoint-dir"
    ]
    assert sorted(os.listdir(d)) == ["LOCK", "flight"]  # nothing half-written
    err = capfd.readouterr().err
    for r in range(2):
        assert (
            f"fastpar: flight recorder: cannot reserve {d}/flight/ring_rank{r}.bin: No space "
            f"left on device (ENOSPC); rank {r} keeps its ring in memory only"
        ) in err, err
    _quiet(err)


def test_a_disk_that_fills_just_after_a_checkpoint_completes_keeps_it(
    small_disk, monkeypatch, capfd
):
    """The disk fills between the checkpoint's completion and the copy of the run's settings
    beside it: the checkpoint is whole and kept, one warning names the missing copy, and the
    run ends well (its last step's save: no other rank is left waiting in a collective)."""
    disk = small_disk(4 * MiB)
    d = os.path.join(disk, "ckpt")
    _on_rank0_after(monkeypatch, checkpoint, "save", {4: lambda: fill(disk, leave=0)})
    records = _run(checkpoint_dir=d)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    step4 = os.path.join(d, "step_000004")
    assert checkpoint.verify(step4)["step"] == 4
    assert "train_config.json" not in os.listdir(step4)
    assert not [f for f in os.listdir(step4) if ".tmp" in f]
    err = capfd.readouterr().err
    assert err.count("warning: ") == 1, err
    assert (
        f"warning: {step4} is complete, but its train_config.json could not be written: No "
        "space left on device (ENOSPC); the checkpoint holds the same settings"
    ) in err
    _quiet(err)


def test_a_flight_dump_that_does_not_fit_is_one_line_and_leaves_nothing(small_disk, capfd):
    """A rank's flight dump (a failed collective's, SIGUSR1's) into a full disk: one line names
    it, nothing is raised into the failure being reported, no temporary file is left."""
    from fastpar import flight

    disk = small_disk(64 * 1024)
    where = os.path.join(disk, "flight")
    os.makedirs(where)
    fill(disk, leave=0)
    assert flight.dump(where, "asked") is None
    assert os.listdir(where) == []
    assert (
        f"fastpar: flight recorder: rank 0 could not write {where}/flight_rank0.json: No space "
        "left on device (ENOSPC)\n"
    ) in capfd.readouterr().err
