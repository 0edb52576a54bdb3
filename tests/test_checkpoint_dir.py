"""A checkpoint directory under a demanding user: two writers (the second refused, a dead one's
lock taken over), shards of two runs refused, steps ordered as numbers past 999,999, --resume
naming what it skips, a fresh run refused over another run's checkpoints, --keep-last, changed
settings warned or refused, --steps below the checkpoint, and resharding across pipeline
layouts (pp 1 -> 2, 2 -> 1, 2 -> 4) for the GPT, the Llama and an --hf-config Qwen3 with tied
embeddings, bit-identical to an uninterrupted run at the new layout."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastpar import checkpoint
from fastpar.checkpoint import CheckpointError
from fastpar.checkpoint import format as ckpt_format
from fastpar.checkpoint.directory import scan
from fastpar.checkpoint.lock import DirectoryLock, LockHeld
from fastpar.testing import RankError, run_ranks
from fastpar.train import TrainConfig, latest_checkpoint, launch, lr_at

# one rank, no MoE; one micro-batch and a clipping threshold never reached, so that pp=1, 2 and
# 4 compute the same sums in the same order (two micro-batches or an active clip would sum the
# tied embedding's gradient or the global norm in another order: equal to ~1e-7 only)
SMALL = dict(
    steps=4,
    save_every=2,
    batch_size=4,
    seq_len=16,
    hidden=32,
    heads=4,
    layers=2,
    tp=1,
    pp=1,
    dp=1,
    ep=1,
    moe_every=0,
    zero=0,
    microbatches=1,
    max_grad_norm=1e9,
    quiet=True,
)


def _run(**overrides) -> list[dict]:
    # a value None leaves the field out: its default
    return launch(TrainConfig(**{k: v for k, v in {**SMALL, **overrides}.items() if v is not None}))


def _losses(records) -> list[float]:
    return [r["loss"] for r in records]


def _steps(records) -> list[int]:
    return [r["step"] for r in records]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """A finished run: checkpoints at steps 2 and 4, and its losses."""
    root = tmp_path_factory.mktemp("run_a") / "ckpt"
    return str(root), _losses(_run(checkpoint_dir=str(root)))


def _copy(run_a, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(run_a[0], dst)
    return dst


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _run_id(ckpt: str) -> str:
    with open(os.path.join(ckpt, "metadata.json")) as f:
        return json.load(f)["run_id"]


# -- the lock ---------------------------------------------------------------------------------
def test_a_live_holder_is_refused_by_name_and_a_released_lock_is_free(tmp_path):
    first = DirectoryLock(str(tmp_path), "run-one")
    assert first.acquire() is None and not first.taken_over
    second = DirectoryLock(str(tmp_path), "run-two")
    pid, host = os.getpid(), socket.gethostname()
    with pytest.raises(LockHeld, match=rf"locked by run 'run-one' \(pid {pid} on host {host}"):
        second.acquire()
    first.release()
    previous = second.acquire()
    assert previous["run_id"] == "run-one" and previous["released"] and not second.taken_over
    second.release()


def _dead_pid() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def _write_lock(directory, **content) -> None:
    now = time.time()
    record = dict(
        host=socket.gethostname(),
        pid=_dead_pid(),
        run_id="old",
        started=now,
        heartbeat=now,
        released=False,
        token="theirs",
    )
    with open(os.path.join(directory, "LOCK"), "w") as f:
        json.dump({**record, **content}, f)


def test_a_dead_holders_lock_is_taken_over_and_other_hosts_go_stale(tmp_path):
    d = str(tmp_path)
    _write_lock(d)  # a writer on this host that died without releasing (kill -9)
    lock = DirectoryLock(d, "new")
    assert lock.acquire()["run_id"] == "old" and lock.taken_over
    lock.release()
    # another host: its process cannot be seen; a fresh heartbeat is refused, a stale one taken
    _write_lock(d, host="elsewhere.invalid", pid=1)
    with pytest.raises(LockHeld, match=r"on host elsewhere\.invalid.*runs on another host"):
        DirectoryLock(d, "new", stale_after_s=60).acquire()
    _write_lock(d, host="elsewhere.invalid", pid=1, heartbeat=time.time() - 120)
    lock = DirectoryLock(d, "new", stale_after_s=60)
    assert lock.acquire()["host"] == "elsewhere.invalid" and lock.taken_over
    _write_lock(d, host="elsewhere.invalid", pid=1)  # ... which took it back meanwhile
    with pytest.raises(LockHeld, match=r"lost the lock .* run 'old' \(pid 1 on host elsewhere"):
        lock.check()
    lock.release()


def test_two_runs_into_one_directory(tmp_path, capfd):
    """A run writing a checkpoint every step; a second run into its directory is refused,
    naming the first's rank 0; after kill -9 of the first, a --resume takes its lock over and
    goes on from its newest complete checkpoint."""
    d = str(tmp_path / "ckpt")
    flags = [
        "--tp",
        "1",
        "--pp",
        "1",
        "--dp",
        "1",
        "--ep",
        "1",
        "--moe-every",
        "0",
        "--steps",
        "100000",
        "--save-every",
        "1",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--layers",
        "2",
        "--microbatches",
        "1",
        "--quiet",
        "--lr-schedule",
        "constant",
        "--checkpoint-dir",
        d,
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "fastpar.train", *flags],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(e.status == "complete" for e in scan(d)):
            assert first.poll() is None, first.stderr.read().decode()
            assert time.monotonic() < deadline, "the first run saved nothing in 120 s"
            time.sleep(0.2)
        with open(os.path.join(d, "LOCK")) as f:
            holder = json.load(f)
        with open(f"/proc/{holder['pid']}/stat") as f:  # the first run's rank 0
            assert int(f.read().rpartition(")")[2].split()[1]) == first.pid
        with pytest.raises(
            RankError,
            match=rf"locked by run '{holder['run_id']}' \(pid "
            rf"{holder['pid']} on host",
        ):
            _run(checkpoint_dir=d, allow_other_run=True)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    while os.path.exists(f"/proc/{holder['pid']}"):
        time.sleep(0.05)
    done = [e for e in scan(d) if os.path.exists(os.path.join(e.path, "COMPLETE"))]
    newest = done[-1].step
    capfd.readouterr()
    # (constant: fewer --steps move no LR, so the resume needs no --allow-schedule-change)
    resumed = _run(checkpoint_dir=d, resume=True, steps=newest + 1, lr_schedule="constant")
    err = capfd.readouterr().err
    assert f"taking over the lock of run '{holder['run_id']}' (pid {holder['pid']}" in err
    assert _steps(resumed) == [newest + 1]


# -- one save, one run ------------------------------------------------------------------------
def _two_saves(a: str, b: str, mix: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    names = dict(model.named_parameters())
    checkpoint.save(a, model_params=names, step=1, run_id="run-a", overwrite=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    if mix and dist.get_rank() == 1:  # run a's rank 1 finishes last in the shared directory
        real = ckpt_format.atomic_json

        def and_then_the_other_run(obj, path):
            out = real(obj, path)
            if path.endswith(ckpt_format.sidecar_file(1)):
                for f in (ckpt_format.rank_file(1), ckpt_format.sidecar_file(1)):
                    shutil.copy(os.path.join(a, f), os.path.join(os.path.dirname(path), f))
            return out

        ckpt_format.atomic_json = and_then_the_other_run
    checkpoint.save(b, model_params=names, step=1, run_id="run-b")


def _rewrite_metadata(path: str, change) -> None:
    """Edit a checkpoint's metadata the way a writer would have written it (marker updated)."""
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    change(meta)
    data = json.dumps(meta).encode()
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(data)
    ckpt_format.write_marker(path, hashlib.sha256(data).hexdigest())


def test_shards_of_two_runs_are_refused(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    with pytest.raises(RankError, match=r"rank 1's shard comes from another save \(run 'run-a'"):
        run_ranks(_two_saves, 2, a, c, True)  # the race: refused before completion
    assert not os.path.exists(c)
    run_ranks(_two_saves, 2, a, b, False)
    side_a = json.load(open(os.path.join(a, "rank00001.json")))  # noqa: SIM115
    shutil.copy(os.path.join(a, "rank00001.pt"), os.path.join(b, "rank00001.pt"))

    def as_an_unchecked_merge_would(meta):  # rank 1's entry from run a's sidecar
        meta["ranks"][1].update({k: side_a[k] for k in ("bytes", "sha256", "run_id", "save_id")})

    _rewrite_metadata(b, as_an_unchecked_merge_would)
    names = dict(nn.Linear(3, 2).named_parameters())
    mixed = r"rank00001\.pt comes from another save \(run 'run-a'"
    with pytest.raises(CheckpointError, match=mixed):
        checkpoint.verify(b)
    with pytest.raises(CheckpointError, match=mixed):
        checkpoint.load(b, model_params=names)

    def only_the_checksum(meta):  # the ids say run b, the file is run a's
        meta["ranks"][1].update({k: side_a[k] for k in ("bytes", "sha256")})
        meta["ranks"][1].update(run_id="run-b", save_id=meta["save_id"])

    _rewrite_metadata(b, only_the_checksum)
    for read in (checkpoint.verify, lambda path: checkpoint.load(path, model_params=names)):
        with pytest.raises(CheckpointError, match=mixed):
            read(b)


# -- the directory ----------------------------------------------------------------------------
def _save_at(cfg: TrainConfig, steps: list[int]) -> None:
    from _mesh import make_mesh

    from fastpar.train.build import Trainer
    from fastpar.train.checkpointing import _save, close_checkpoints

    trainer = Trainer(cfg, make_mesh(1, 1, 1), torch.device("cpu"))
    for step in steps:
        trainer.step_count = step
        _save(trainer, cfg.checkpoint_dir, step, False)
    close_checkpoints(trainer)


def test_steps_are_ordered_as_numbers_past_999999(tmp_path, capfd):
    d = str(tmp_path / "ckpt")
    cfg = TrainConfig(**{**SMALL, "checkpoint_dir": d, "steps": 1_000_001})
    run_ranks(_save_at, 1, cfg, [999_999, 1_000_000])
    assert sorted(os.listdir(d)) == ["LOCK", "step_1000000", "step_999999", "train_config.json"]
    assert latest_checkpoint(d) == os.path.join(d, "step_1000000")
    capfd.readouterr()
    records = _run(checkpoint_dir=d, resume=True, steps=1_000_001, quiet=False)
    assert _steps(records) == [1_000_001]
    assert f"resume: {d}/step_1000000 (step 1000000" in capfd.readouterr().out


def test_resume_names_a_corrupted_newest_checkpoint(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    _flip_byte(os.path.join(d, "step_000004", "rank00000.pt"))
    resumed = _run(checkpoint_dir=d, resume=True, steps=5)
    err = capfd.readouterr().err
    assert f"skipping {d}/step_000004: corrupted (sha256 mismatch for rank00000.pt" in err
    assert _steps(resumed) == [3, 4, 5]
    assert _losses(resumed)[:2] == run_a[1][2:]  # the same layout: bit for bit


def test_resume_names_an_incomplete_checkpoint(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    os.remove(os.path.join(d, "step_000004", "COMPLETE"))
    assert _steps(_run(checkpoint_dir=d, resume=True)) == [3, 4]
    assert f"skipping {d}/step_000004: incomplete (no completion marker" in capfd.readouterr().err


def test_resume_with_only_a_corrupted_checkpoint_fails_unless_allow_fresh(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    shutil.rmtree(os.path.join(d, "step_000004"))
    _flip_byte(os.path.join(d, "step_000002", "rank00000.pt"))
    with pytest.raises(
        RankError,
        match=r"holds no usable checkpoint \(step_000002: corrupted "
        r"\(sha256 mismatch for rank00000\.pt.*pass --allow-fresh",
    ):
        _run(checkpoint_dir=d, resume=True)
    capfd.readouterr()
    fresh = _run(checkpoint_dir=d, resume=True, allow_fresh=True, steps=1)
    assert _steps(fresh) == [1] and _losses(fresh) == run_a[1][:1]
    assert "starting from step 0 (--allow-fresh)" in capfd.readouterr().err


def test_a_fresh_run_over_another_runs_checkpoints(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    old = _run_id(os.path.join(d, "step_000004"))
    with pytest.raises(
        RankError,
        match=rf"holds another run's checkpoints \(2 checkpoints, "
        rf"step_000002 to step_000004, of run {old}\): pass --resume",
    ):
        _run(checkpoint_dir=d)
    # another run's checkpoint is never overwritten: a run that would save step 2 is refused
    # before its first step, and step 2 stays the first run's
    with pytest.raises(RankError, match=r"would save over another run's checkpoints \(step_000002"):
        _run(checkpoint_dir=d, allow_other_run=True, steps=2, seed=7)
    assert _run_id(os.path.join(d, "step_000002")) == old
    _run(checkpoint_dir=d, allow_other_run=True, steps=3, save_every=3, seed=7)  # step 3 only
    new = _run_id(os.path.join(d, "step_000003"))
    assert new != old and _run_id(os.path.join(d, "step_000004")) == old
    capfd.readouterr()
    resumed = _run(checkpoint_dir=d, resume=True, steps=5, save_every=5, seed=7)  # not step 4
    assert _steps(resumed) == [4, 5]
    assert f"skipping {d}/step_000004: another run's (run '{old}'" in capfd.readouterr().err
    assert _run_id(os.path.join(d, "step_000005")) == new
    with pytest.raises(RankError, match=r"would save over another run's checkpoints \(step_000004"):
        _run(checkpoint_dir=d, allow_other_run=True, steps=8, save_every=4)  # 4 and 8


def test_keep_last_never_deletes_a_checkpoint_being_read(tmp_path, capfd):
    d = str(tmp_path / "ckpt")
    _run(checkpoint_dir=d, steps=5, save_every=1, keep_last=2)
    # (flight/: the run's flight records, docs/debugging.md)
    assert sorted(os.listdir(d)) == [
        "LOCK",
        "flight",
        "step_000004",
        "step_000005",
        "train_config.json",
    ]
    reader = checkpoint.CheckpointReader(os.path.join(d, "step_000004"))
    try:
        _run(checkpoint_dir=d, steps=7, save_every=1, keep_last=1, resume=True)
    finally:
        reader.release()
    assert sorted(os.listdir(d)) == [
        "LOCK",
        "flight",
        "step_000004",
        "step_000007",
        "train_config.json",
    ]
    assert f"--keep-last: kept {d}/step_000004: it is being read" in capfd.readouterr().err


def test_changed_settings_warn_or_refuse_and_steps_below_is_an_error(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    with pytest.raises(
        RankError,
        match=r"saved with another model \(--hidden 32 -> 48; "
        r"--layers 2 -> 3\)",
    ):
        _run(checkpoint_dir=d, resume=True, hidden=48, layers=3, steps=5)
    with pytest.raises(RankError, match=r"--steps 3 is below the step 4 of .*step_000004"):
        _run(checkpoint_dir=d, resume=True, steps=3)
    capfd.readouterr()
    assert _steps(_run(checkpoint_dir=d, resume=True, steps=5, seed=7, weight_decay=0.0)) == [5]
    assert "changed settings: --seed 1234 -> 7; --weight-decay 0.1 -> 0.0" in capfd.readouterr().err


# -- a changed learning-rate schedule ---------------------------------------------------------
#: past the warm-up from step 1 on, so that --steps moves the cosine schedule
COSINE = dict(warmup=1)


@pytest.fixture(scope="module")
def run_cos(tmp_path_factory):
    """A cosine run of 4 steps, warm-up 1: its checkpoint of step 2 only."""
    root = tmp_path_factory.mktemp("run_cos") / "ckpt"
    _run(checkpoint_dir=str(root), **COSINE)
    shutil.rmtree(root / "step_000004")  # interrupted after step 2
    return str(root)


def _rates(old: dict, new: dict, step: int) -> str:
    """The message's LRs of the two steps after ``step``, from ``lr_at`` of both settings."""
    was, now = TrainConfig(**{**SMALL, **old}), TrainConfig(**{**SMALL, **new})
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
    flag = f"--{name} {getattr(TrainConfig(**SMALL), name)} -> {value}"
    rates = _rates(COSINE, new, 2)
    was, now = TrainConfig(**{**SMALL, **COSINE}), TrainConfig(**{**SMALL, **new})
    assert lr_at(was, 2) != lr_at(now, 2)  # the jump the message names
    with pytest.raises(RankError) as err:
        _run(checkpoint_dir=d, resume=True, **new)
    text = str(err.value.exception)
    assert f"{d}/step_000002 changes the LR schedule ({flag}): {rates}" in text, text
    assert "resume with the saved values, or pass --allow-schedule-change" in text, text
    assert "changed settings" not in capfd.readouterr().err  # said once, not as a warning too
    resumed = _run(checkpoint_dir=d, resume=True, allow_schedule_change=True, **new)
    assert _steps(resumed) == list(range(3, now.steps + 1))
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
    _run(checkpoint_dir=d, **flat)
    capfd.readouterr()
    resumed = _run(checkpoint_dir=d, resume=True, steps=6, quiet=False, **flat)
    out, err = capfd.readouterr()
    assert _steps(resumed) == [5, 6]
    assert (
        f"note: --resume from {d}/step_000004: --steps 4 -> 6 leaves the LR of every step "
        "both settings train unchanged; the run now ends at step 6"
    ) in out, out
    assert out.count("note:") == 1 and "warning" not in err, err
    straight = _run(steps=6, save_every=0, **flat)
    assert _losses(resumed) == _losses(straight)[4:]


def test_a_bin_runs_data_dtype_is_recorded_resolved_and_resumes_quietly(tmp_path, capfd):
    """--data-dtype left out is recorded as the uint16 it resolves to: a resume that leaves
    it out again (or a checkpoint of before, which recorded "uint16") changes no setting."""
    import numpy as np

    ids = tmp_path / "ids.bin"
    (np.arange(5000, dtype=np.uint16) % 512).tofile(ids)
    d = str(tmp_path / "ckpt")
    _run(checkpoint_dir=d, data=str(ids), vocab_size=512, steps=2)
    with open(os.path.join(d, "step_000002", "train_config.json")) as f:
        assert json.load(f)["data_dtype"] == "uint16"
    capfd.readouterr()
    assert _steps(_run(checkpoint_dir=d, data=str(ids), vocab_size=512, steps=3, resume=True)) == [
        3
    ]
    assert "changed settings" not in capfd.readouterr().err


def test_compare_schedule_and_data_dtype_records():
    """The steps both settings train decide; --data-dtype is compared for a .bin file only
    (a text run recorded "uint16" before it was left unset)."""
    from dataclasses import asdict

    from fastpar.train.checkpointing import compare_schedule, compare_settings

    saved = {"config": asdict(TrainConfig(**{**SMALL, "warmup": 5, "steps": 10}))}
    assert compare_schedule(saved, TrainConfig(**{**SMALL, "warmup": 5, "steps": 10}), 2) is None
    # in the warm-up, whose rates --steps does not move: steps 2..3 of both runs
    assert compare_schedule(saved, TrainConfig(**{**SMALL, "warmup": 5, "steps": 4}), 2)[2] is False
    assert compare_schedule(saved, TrainConfig(**{**SMALL, "warmup": 5, "steps": 12}), 8)[2]
    saved["config"]["data_dtype"] = "uint16"
    assert compare_settings(saved, TrainConfig(**SMALL)) == ([], [])
    bin_cfg = TrainConfig(**SMALL, data="ids.bin", data_dtype="uint32")
    assert compare_settings(saved, bin_cfg)[1] == [
        "--data None -> ids.bin",
        "--data-dtype uint16 -> uint32",
    ]


# -- resharding across pipeline layouts -------------------------------------------------------
def _model_flags(kind: str, tmp_path_factory) -> dict:
    if kind == "gpt":
        return {}
    if kind == "llama":
        return dict(model_type="llama", kv_heads=2, qk_norm=True)
    hf = pytest.importorskip("_hf", reason="the hf extra (pip install fastpar[hf])")
    path = tmp_path_factory.mktemp("qwen3") / "config.json"
    path.write_text(json.dumps(hf.config("qwen3", vocab_size=300).to_dict()))  # tied embeddings
    hf.build("qwen3")  # transformers' model modules imported once, here, not in every rank
    return dict(hf_config=str(path), hidden=None, heads=None, layers=None)


@pytest.fixture(scope="module", params=["gpt", "llama", "qwen3"])
def uninterrupted(request, tmp_path_factory):
    """Per model: {pp: (losses, final parameters, checkpoint dir)} of runs without a break."""
    flags = _model_flags(request.param, tmp_path_factory)
    out = {}
    for pp in (1, 2, 4):
        d = str(tmp_path_factory.mktemp(f"{request.param}-pp{pp}") / "ckpt")
        losses = _losses(_run(checkpoint_dir=d, pp=pp, **flags))
        out[pp] = losses, checkpoint.export_state_dict(os.path.join(d, "step_000004")), d
    return flags, out


@pytest.mark.parametrize("src, dst", [(1, 2), (2, 1), (2, 4)], ids=["1to2", "2to1", "2to4"])
def test_a_checkpoint_resumes_exactly_at_another_pipeline_layout(uninterrupted, src, dst, tmp_path):
    flags, runs = uninterrupted
    d = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(runs[src][2], "step_000002"), os.path.join(d, "step_000002"))
    resumed = _run(checkpoint_dir=d, resume=True, pp=dst, **flags)
    losses, params, _ = runs[dst]
    assert _steps(resumed) == [3, 4]
    assert _losses(resumed) == losses[2:]
    got = checkpoint.export_state_dict(os.path.join(d, "step_000004"))
    assert set(got) == set(params) == set(runs[1][1])  # the tied embedding: once, at any pp
    assert [n for n in params if not torch.equal(got[n], params[n])] == []
