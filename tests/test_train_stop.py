"""Faults injected into the real command (``python -m fastpar.train``, self-started and under
``torchrun``): a stopped rank, SIGTERM / SIGINT / SIGKILL of the launcher or of one rank, a
diverged run. Each checks the exit, the message, what was saved, and that no process is left."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from _flags import argv
from _procs import alive, children, kill_all

from fastpar.checkpoint import CheckpointError, export_state_dict, verify

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="signals to ranks found through Linux's /proc"
)

#: a model that starts in about a second and runs a step in milliseconds; a constant LR, so a
#: run's steps do not depend on --steps
MODEL = dict(batch_size=4, seq_len=16, hidden=32, heads=2, layers=2)
SMALL = argv(pp=1, ep=1, moe_every=0, **MODEL, lr_schedule="constant", warmup=0, log_every=1)
#: fp16 at an LR that overflows every step
FP16_OVERFLOWS = dict(dp=2, tp=1, steps=50, lr="1e30", precision="fp16")
SLACK = 10.0  # seconds past the collective timeout, generous for 2 busy cores


class Job:
    """The command in a subprocess, its output collected as it comes."""

    def __init__(self, *args: str, torchrun: int = 0):
        launcher = [sys.executable, "-m", "fastpar.train"]
        if torchrun:
            launcher = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(torchrun),
                "-m",
                "fastpar.train",
            ]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        # a background job (CI) inherits SIGINT ignored; a user's Ctrl-C reaches a foreground one
        self.proc = subprocess.Popen(
            [*launcher, *SMALL, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(s, b), daemon=True)
            for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self.readers:
            t.start()
        self.ranks: list[int] = []

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def wait_for_step(self, step: int, ranks: int, timeout: float = 120.0) -> None:
        """Until rank 0 printed ``step`` and ``ranks`` rank processes are found (their pids in
        ``self.ranks``: the launcher's children, or torchrun's)."""
        deadline = time.monotonic() + timeout
        pattern = re.compile(rf"step +{step}/")
        while not any(pattern.search(line) for line in list(self.out)):
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.text[-3000:]}"
            assert time.monotonic() < deadline, f"no step {step}:\n{self.text[-3000:]}"
            time.sleep(0.05)
        kids = children(self.proc.pid)
        self.ranks = sorted(p for p, (_, cmd) in kids.items() if "fastpar.train" in cmd)
        assert len(self.ranks) == ranks, kids

    def finish(self, timeout: float = 120.0) -> tuple[int, float]:
        """(exit code, seconds it took to exit)."""
        t0 = time.monotonic()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.text[-3000:]}") from None
        for t in self.readers:
            t.join(timeout=10)
        return code, time.monotonic() - t0

    def kill(self) -> None:
        kill_all([*self.ranks, self.proc.pid])
        self.proc.wait(timeout=30)

    def losses(self) -> dict[int, str]:
        """{step: the loss rank 0 printed}."""
        found = (re.search(r"step +(\d+)/\d+ \| loss (\S+)", line) for line in self.out)
        return {int(m.group(1)): m.group(2) for m in found if m}


@contextlib.contextmanager
def job(*args: str, torchrun: int = 0):
    j = Job(*args, torchrun=torchrun)
    try:
        yield j
    finally:
        if j.proc.poll() is None or alive(j.ranks, 0):
            j.kill()


def _checkpoints(root) -> dict[int, str]:
    """{step: path} of the checkpoints under ``root`` that verify in full."""
    out = {}
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = re.fullmatch(r"step_(\d+)", name)
        if m:
            with contextlib.suppress(CheckpointError):
                verify(os.path.join(root, name))
                out[int(m.group(1))] = os.path.join(root, name)
    return out


# -- a stopped rank ------------------------------------------------------------------------------
def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it():
    with job("--tp", "2", "--dp", "2", "--steps", "100000", "--collective-timeout", "5") as j:
        j.wait_for_step(2, ranks=4)
        stopped = next(
            p for p, (name, _) in children(j.proc.pid).items() if name == "fastpar-rank2"
        )
        os.kill(stopped, signal.SIGSTOP)
        code, seconds = j.finish()
    assert code != 0
    assert 4.0 < seconds < 5 + SLACK, j.text[-3000:]  # the 5 s timeout fired, on a tp group
    assert "no answer from rank 2 (its process is stopped: SIGSTOP or a debugger)" in j.text
    assert "Timed out waiting 5000ms" in j.text
    # the flight recorder: a group the stopped rank left its peers waiting in
    assert re.search(
        r"first disagreement: group (dp\[0,2\]|tp\[2,3\]): #\d+ \w+: rank 2 sent no dump "
        r"\(stopped: SIGSTOP or a debugger\); waiting for it: rank [03] in (dp\[0,2\]|tp\[2,3\])",
        j.text,
    ), j.text[-3000:]
    assert alive(j.ranks) == []


@pytest.mark.slow
def test_a_stopped_rank_under_torchrun_ends_the_job_within_the_timeout_naming_it():
    with job(
        "--dp", "2", "--tp", "1", "--steps", "100000", "--collective-timeout", "5", torchrun=2
    ) as j:
        j.wait_for_step(2, ranks=2)
        stopped = j.ranks[1]
        with open(f"/proc/{stopped}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        rank = env[b"RANK"].decode()
        os.kill(stopped, signal.SIGSTOP)
        code, seconds = j.finish()
    assert code != 0
    # torchrun alone would give the stopped rank its 30 s shutdown grace on top
    assert 4.0 < seconds < 5 + SLACK, j.text[-3000:]
    assert f"no answer from rank {rank} (pid {stopped}): its process is stopped" in j.text
    # the flight recorder's analysis, printed by the lowest rank that dumped
    assert "fastpar: flight recorder, 1 dumps in" in j.text, j.text[-3000:]
    assert re.search(rf"first disagreement: group \S+: #\d+ \w+: rank {rank} sent no dump", j.text)
    assert alive(j.ranks) == []


# -- signals: preemption -----------------------------------------------------------------------
def _preempt(ckpt: str, sig: signal.Signals, torchrun: int = 0) -> int:
    """Run until step 2, send ``sig`` (to the launcher; to one rank under torchrun), check that
    every rank stopped after one same step, with a checkpoint of it, and no process left.
    Returns the step."""
    with job(
        "--dp", "2", "--tp", "1", "--steps", "100000", "--checkpoint-dir", ckpt, torchrun=torchrun
    ) as j:
        j.wait_for_step(2, ranks=2)
        os.kill(j.ranks[1] if torchrun else j.proc.pid, sig)
        code, _ = j.finish()
    assert code != 0 and (torchrun or code == 1), j.text[-3000:]
    m = re.search(rf"stopped by {sig.name} after step (\d+); checkpoint (\S+)", j.text)
    assert m, j.text[-3000:]
    step = int(m.group(1))
    assert max(j.losses()) == step  # it finished the step it was in, and no other
    assert _checkpoints(ckpt) == {step: m.group(2)}
    assert alive(j.ranks) == []
    return step


def test_sigterm_to_the_launcher_saves_the_step_and_resume_continues_it(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    step = _preempt(ckpt, signal.SIGTERM)
    with job(
        "--dp", "2", "--tp", "1", "--steps", str(step + 2), "--checkpoint-dir", ckpt, "--resume"
    ) as resumed:
        assert resumed.finish()[0] == 0, resumed.text[-3000:]
    with job("--dp", "2", "--tp", "1", "--steps", str(step + 2)) as straight:
        assert straight.finish()[0] == 0, straight.text[-3000:]
    assert sorted(resumed.losses()) == [step + 1, step + 2]  # it went on from the saved step
    for s in (step + 1, step + 2):  # as if never stopped
        assert resumed.losses()[s] == straight.losses()[s]


@pytest.mark.parametrize(
    "sig,torchrun",
    [
        (signal.SIGINT, 0),
        pytest.param(signal.SIGHUP, 0, marks=pytest.mark.slow),  # a closed terminal
        pytest.param(signal.SIGTERM, 2, marks=pytest.mark.slow),
    ],
    ids=["sigint-launcher", "sighup-launcher", "sigterm-one-rank-torchrun"],
)
def test_a_signal_stops_every_rank_after_one_step_and_saves_it(tmp_path, sig, torchrun):
    _preempt(str(tmp_path / "ckpt"), sig, torchrun)


def test_sigkill_of_the_launcher_leaves_no_rank_running():
    with job("--dp", "2", "--tp", "1", "--steps", "100000") as j:
        j.wait_for_step(2, ranks=2)
        j.proc.kill()
        j.finish()
        assert alive(j.ranks, seconds=10) == []


# -- a diverged run ----------------------------------------------------------------------------
def test_a_non_finite_loss_stops_the_run_and_is_not_saved(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with job(
        "--dp",
        "2",
        "--tp",
        "1",
        "--steps",
        "50",
        "--lr",
        "1e30",
        "--save-every",
        "1",
        "--checkpoint-dir",
        ckpt,
    ) as j:
        code, _ = j.finish()
    assert code == 1
    m = re.search(r"diverged at step (\d+): the loss is nan \(fp32, --lr 1e\+30\)", j.text)
    assert m, j.text[-3000:]
    step = int(m.group(1))
    assert max(j.losses()) == step < 50
    saved = _checkpoints(ckpt)
    assert sorted(saved) == list(range(1, step))  # every step before it, not it
    for path in saved.values():
        assert all(torch.isfinite(t).all() for t in export_state_dict(path).values())


def test_fp16_stops_after_max_skipped_steps_in_a_row():
    with job(*argv(**FP16_OVERFLOWS, max_skipped_steps=3)) as j:
        code, _ = j.finish()
    assert code == 1
    m = re.search(r"diverged at step (\d+): 3 steps in a row \(steps (\d+)-(\d+)\) skipped", j.text)
    assert m, j.text[-3000:]
    step, first, last = map(int, m.groups())
    assert last == step == first + 2 == max(j.losses())


def test_fp16_trains_from_the_largest_accepted_loss_scale():
    """--loss-scale 2^40 (the bound): its first 29 steps overflow while the scaler halves down
    to the default's 4096 (hysteresis 2: 1 + 28 steps), which --max-skipped-steps (default 20)
    does not count; the run then trains to its end with finite losses. (Counted from the
    start, it stopped at step 20: "every step so far (20) skipped".)"""
    flags = ["--dp", "2", "--tp", "1", "--steps", "34"]
    with job(*flags, "--precision", "fp16", "--loss-scale", str(2**40)) as j:
        code, _ = j.finish()
    assert code == 0, j.text[-3000:]
    assert "every step so far" not in j.text and "diverged" not in j.text
    losses = j.losses()
    assert max(losses) == 34, sorted(losses)
    assert all(float(v) == float(v) and abs(float(v)) < 100 for v in losses.values()), losses


def test_weights_that_overflow_fp16_are_never_saved(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with job(*argv(**FP16_OVERFLOWS, save_every=1, checkpoint_dir=ckpt)) as j:
        code, _ = j.finish()
    assert code == 1
    assert re.search(r"diverged at step 1: the weights are no longer finite in fp16", j.text), (
        j.text[-3000:]
    )
    assert _checkpoints(ckpt) == {}
