"""The training loop reads numbers on the host only at sync points (logged steps, every
``--log-every``, and save steps): a counter of host reads and collectives made by the trainer's
own code (``fastpar.train.*``) over a real run; the numbers read late are the numbers read at
once; a signal and a divergence between sync points stop the run at the next one, unsaved."""

from __future__ import annotations

import os
import signal
import sys
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from _flags import ONE_RANK, tiny_config

import fastpar.train.build as train_build
from fastpar.testing import RankError, run_ranks
from fastpar.train import RunStopped, TrainConfig
from fastpar.train.loop import run

#: 4 ranks (pp 2 x dp 2), a step in milliseconds
SMALL = tiny_config(ONE_RANK, pp=2, dp=2, zero=1, warmup=0, lr_schedule="constant", steps=None)
HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
    "broadcast_object_list",
    "all_gather_object",
    "send",
    "recv",
)


def _by_the_trainer() -> bool:
    """Whether the nearest fastpar frame up the stack is the trainer's own code (the thin
    wrappers of ``fastpar.comm.plain`` skipped: the collective is its caller's)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != "fastpar.comm.plain" and (name == "fastpar" or name.startswith("fastpar.")):
            return name.startswith("fastpar.train.")
        frame = frame.f_back
    return False


def _count(cfg: TrainConfig) -> dict:
    """Run ``cfg`` counting the trainer's host reads and collectives: {"in step": n, after
    step k: n} (what happens between the end of step k and the start of step k + 1)."""
    counts: dict = defaultdict(int)
    where = ["set-up"]
    step = train_build.Trainer.step

    def counted_step(self):
        where[0] = "in step"
        try:
            return step(self)
        finally:
            where[0] = self.step_count

    def wrap(owner, name):
        real = getattr(owner, name)

        def counting(*args, **kwargs):
            if _by_the_trainer():
                counts[where[0]] += 1
            return real(*args, **kwargs)

        setattr(owner, name, counting)

    train_build.Trainer.step = counted_step
    for name in HOST_READS:
        wrap(torch.Tensor, name)
    for name in COLLECTIVES:
        wrap(dist, name)
    run(cfg)
    return dict(counts)


def test_unlogged_steps_make_no_host_sync(tmp_path):
    cfg = TrainConfig.from_flags(
        **SMALL, steps=7, log_every=3, checkpoint_dir=str(tmp_path / "ckpt"), save_every=5
    )
    for rank, counts in enumerate(run_ranks(_count, cfg.world_size, cfg, timeout=240)):
        assert counts.get("in step", 0) == 0, (rank, counts)
        synced = sorted(k for k in counts if isinstance(k, int))
        assert synced == [3, 5, 6, 7], (rank, counts)  # logged: 3, 6, 7 (the last); saved: 5, 7


def _records(cfgs: list[TrainConfig]) -> list[list[dict]]:
    return [run(cfg) for cfg in cfgs]


def test_numbers_read_late_equal_numbers_read_at_once():
    every = TrainConfig.from_flags(**SMALL, steps=5, log_every=1)
    late = TrainConfig.from_flags(**SMALL, steps=5, log_every=4)
    at_once, deferred = run_ranks(_records, every.world_size, [every, late], timeout=240)[0]
    assert [r["step"] for r in deferred] == [1, 2, 3, 4, 5]
    for a, b in zip(at_once, deferred, strict=True):
        assert (a["loss"], a["grad_norm"], a["skipped"]) == (
            b["loss"],
            b["grad_norm"],
            b["skipped"],
        )
        assert isinstance(b["loss"], float) and isinstance(b["skipped"], bool)
    assert "max_mem_mib" in deferred[3] and "max_mem_mib" not in deferred[2]  # logged: 4, 5


def _signalled_at(cfg: TrainConfig, at: int):
    """SIGTERM to this rank during step ``at``; returns the RunStopped."""
    step = train_build.Trainer.step

    def signalled(self):
        if self.step_count + 1 == at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self)

    train_build.Trainer.step = signalled
    try:
        run(cfg)
    except RunStopped as stop:
        return stop.step, stop.cause, stop.checkpoint
    raise AssertionError("the run did not stop")


def test_a_signal_is_acted_on_at_the_next_logged_step(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cfg = TrainConfig.from_flags(**SMALL, steps=20, log_every=4, checkpoint_dir=ckpt)
    out = run_ranks(_signalled_at, cfg.world_size, cfg, 2, timeout=240)
    assert out == [(4, "SIGTERM", os.path.join(ckpt, "step_000004"))] * 4
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("step_")) == ["step_000004"]


def test_a_divergence_between_sync_points_stops_the_next_one_unsaved(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig.from_flags(
        **SMALL, steps=20, lr=1e30, log_every=3, save_every=3, checkpoint_dir=str(ckpt)
    )
    with pytest.raises(RankError) as err:
        run_ranks(run, cfg.world_size, cfg, timeout=240)
    stop = err.value.exception
    assert isinstance(stop, RunStopped) and stop.cause == "non-finite loss", err.value
    assert stop.step == 3  # the sync point after the divergence (step 2: the loss after 1e30)
    assert "diverged at step 2: the loss is nan (fp32, --lr 1e+30); steps 2-3 not saved" in str(
        stop
    )
    assert not [n for n in os.listdir(ckpt) if n.startswith("step_")]
