"""A checkpoint directory under a demanding user: shards of two runs refused, steps ordered as
numbers past 999,999, --resume naming what it skips, a fresh run refused over another run's
checkpoints, --keep-last, changed settings warned or refused, --steps below the checkpoint, and
resharding across pipeline layouts (pp 1 -> 2, 2 -> 1, 2 -> 4) for the GPT, the Llama and an
--hf-config Qwen3 with tied embeddings, bit-identical to an uninterrupted run at the new layout.
The lock: tests/test_checkpoint_lock.py; a changed LR schedule:
tests/test_train_checkpointing.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from _checkpoint_runs import SMALL, losses, run, steps
from torch import nn

from fastpar import checkpoint
from fastpar.checkpoint import CheckpointError
from fastpar.checkpoint import format as ckpt_format
from fastpar.testing import RankError, run_ranks
from fastpar.train import TrainConfig, latest_checkpoint


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """A finished run: checkpoints at steps 2 and 4, and its losses."""
    root = tmp_path_factory.mktemp("run_a") / "ckpt"
    return str(root), losses(run(checkpoint_dir=str(root)))


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
def _save_at(cfg: TrainConfig, at: list[int]) -> None:
    from _mesh import make_mesh

    from fastpar.train.build import Trainer
    from fastpar.train.checkpointing import _save, close_checkpoints

    trainer = Trainer(cfg, make_mesh(1, 1, 1), torch.device("cpu"))
    for step in at:
        trainer.step_count = step
        _save(trainer, cfg.checkpoint_dir, step, False)
    close_checkpoints(trainer)


def test_steps_are_ordered_as_numbers_past_999999(tmp_path, capfd):
    d = str(tmp_path / "ckpt")
    cfg = TrainConfig.from_flags(**{**SMALL, "checkpoint_dir": d, "steps": 1_000_001})
    run_ranks(_save_at, 1, cfg, [999_999, 1_000_000])
    assert sorted(os.listdir(d)) == ["LOCK", "step_1000000", "step_999999", "train_config.json"]
    assert latest_checkpoint(d) == os.path.join(d, "step_1000000")
    capfd.readouterr()
    records = run(checkpoint_dir=d, resume=True, steps=1_000_001, quiet=False)
    assert steps(records) == [1_000_001]
    assert f"resume: {d}/step_1000000 (step 1000000" in capfd.readouterr().out


def test_resume_names_a_corrupted_newest_checkpoint(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    _flip_byte(os.path.join(d, "step_000004", "rank00000.pt"))
    resumed = run(checkpoint_dir=d, resume=True, steps=5)
    err = capfd.readouterr().err
    assert f"skipping {d}/step_000004: corrupted (sha256 mismatch for rank00000.pt" in err
    assert steps(resumed) == [3, 4, 5]
    assert losses(resumed)[:2] == run_a[1][2:]  # the same layout: bit for bit


def test_resume_names_an_incomplete_checkpoint(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    os.remove(os.path.join(d, "step_000004", "COMPLETE"))
    assert steps(run(checkpoint_dir=d, resume=True)) == [3, 4]
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
        run(checkpoint_dir=d, resume=True)
    capfd.readouterr()
    fresh = run(checkpoint_dir=d, resume=True, allow_fresh=True, steps=1)
    assert steps(fresh) == [1] and losses(fresh) == run_a[1][:1]
    assert "starting from step 0 (--allow-fresh)" in capfd.readouterr().err


def test_a_fresh_run_over_another_runs_checkpoints(run_a, tmp_path, capfd):
    d = _copy(run_a, tmp_path)
    old = _run_id(os.path.join(d, "step_000004"))
    with pytest.raises(
        RankError,
        match=rf"holds another run's checkpoints \(2 checkpoints, "
        rf"step_000002 to step_000004, of run {old}\): pass --resume",
    ):
        run(checkpoint_dir=d)
    # another run's checkpoint is never overwritten: a run that would save step 2 is refused
    # before its first step, and step 2 stays the first run's
    with pytest.raises(RankError, match=r"would save over another run's checkpoints \(step_000002"):
        run(checkpoint_dir=d, allow_other_run=True, steps=2, seed=7)
    assert _run_id(os.path.join(d, "step_000002")) == old
    run(checkpoint_dir=d, allow_other_run=True, steps=3, save_every=3, seed=7)  # step 3 only
    new = _run_id(os.path.join(d, "step_000003"))
    assert new != old and _run_id(os.path.join(d, "step_000004")) == old
    capfd.readouterr()
    resumed = run(checkpoint_dir=d, resume=True, steps=5, save_every=5, seed=7)  # not step 4
    assert steps(resumed) == [4, 5]
    assert f"skipping {d}/step_000004: another run's (run '{old}'" in capfd.readouterr().err
    assert _run_id(os.path.join(d, "step_000005")) == new
    with pytest.raises(RankError, match=r"would save over another run's checkpoints \(step_000004"):
        run(checkpoint_dir=d, allow_other_run=True, steps=8, save_every=4)  # 4 and 8


def test_keep_last_never_deletes_a_checkpoint_being_read(tmp_path, capfd):
    d = str(tmp_path / "ckpt")
    run(checkpoint_dir=d, steps=5, save_every=1, keep_last=2)
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
        run(checkpoint_dir=d, steps=7, save_every=1, keep_last=1, resume=True)
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
        run(checkpoint_dir=d, resume=True, hidden=48, layers=3, steps=5)
    with pytest.raises(RankError, match=r"--steps 3 is below the step 4 of .*step_000004"):
        run(checkpoint_dir=d, resume=True, steps=3)
    capfd.readouterr()
    assert steps(run(checkpoint_dir=d, resume=True, steps=5, seed=7, weight_decay=0.0)) == [5]
    assert "changed settings: --seed 1234 -> 7; --weight-decay 0.1 -> 0.0" in capfd.readouterr().err


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
        got = losses(run(checkpoint_dir=d, pp=pp, **flags))
        out[pp] = got, checkpoint.export_state_dict(os.path.join(d, "step_000004")), d
    return flags, out


@pytest.mark.parametrize("src, dst", [(1, 2), (2, 1), (2, 4)], ids=["1to2", "2to1", "2to4"])
def test_a_checkpoint_resumes_exactly_at_another_pipeline_layout(uninterrupted, src, dst, tmp_path):
    flags, runs = uninterrupted
    d = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(runs[src][2], "step_000002"), os.path.join(d, "step_000002"))
    resumed = run(checkpoint_dir=d, resume=True, pp=dst, **flags)
    want, params, _ = runs[dst]
    assert steps(resumed) == [3, 4]
    assert losses(resumed) == want[2:]
    got = checkpoint.export_state_dict(os.path.join(d, "step_000004"))
    assert set(got) == set(params) == set(runs[1][1])  # the tied embedding: once, at any pp
    assert [n for n in params if not torch.equal(got[n], params[n])] == []
