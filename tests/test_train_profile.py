"""--profile with --profile-steps A:B: only steps A to B recorded, each in a ProfilerStep#N range
(N the run's step), fastpar's named ranges visible in a CPU trace (record_function), the flag's
checks, --quiet silencing the profiler's own lines, and Kineto's lines on rank 0 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _flags import ONE_RANK, tiny_argv, tiny_config
from _no_ranks import forbid_ranks
from _procs import run_module

from fastpar.profiling import nvtx
from fastpar.train import TrainConfig, launch, main

#: 2 ranks (pp 2), dense
#: 2 ranks (pp 2), a step in milliseconds
TINY = tiny_config(ONE_RANK, pp=2, steps=4)


def _names(path) -> list[str]:
    return [e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]]


def test_profile_steps_records_only_that_window(tmp_path):
    out = tmp_path / "prof"
    launch(TrainConfig.from_flags(**TINY, profile=str(out), profile_steps="2:3"))
    assert sorted(os.listdir(out)) == ["trace_rank0.json", "trace_rank1.json"]
    for rank in (0, 1):
        names = _names(out / f"trace_rank{rank}.json")
        steps = sorted({n for n in names if n.startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps
        # fastpar's own ranges, as record_function on a CPU
        assert f"stage{rank} forward mb0" in names and f"stage{rank} backward mb1" in names
        assert "optimizer step" in names
        assert names.count("optimizer step") == 2  # steps 2 and 3, nothing of steps 1 and 4


def test_profile_without_steps_records_every_step(tmp_path):
    out = tmp_path / "prof"
    launch(TrainConfig.from_flags(**{**TINY, "steps": 2, "pp": 1}, profile=str(out)))
    names = _names(out / "trace_rank0.json")
    assert sorted({n for n in names if n.startswith("ProfilerStep#")}) == [
        "ProfilerStep#1",
        "ProfilerStep#2",
    ]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--profile-steps", "1:2"], "--profile-steps '1:2' needs --profile DIR"),
        (["--profile", "P", "--profile-steps", "3"], "must be A:B, two step numbers"),
        (["--profile", "P", "--profile-steps", "a:b"], "must be A:B, two step numbers"),
        (["--profile", "P", "--profile-steps", "0:2"], "must satisfy 1 <= A <= B <= --steps 30"),
        (["--profile", "P", "--profile-steps", "5:4"], "must satisfy 1 <= A <= B"),
        (["--profile", "P", "--profile-steps", "2:31"], "must satisfy 1 <= A <= B <= --steps 30"),
        (["--peak-tflops", "0"], "--peak-tflops 0 must be a positive finite number"),
        (["--peak-tflops", "nan"], "--peak-tflops nan must be a positive finite number"),
    ],
)
def test_profile_flag_errors(argv, message, capsys, monkeypatch, tmp_path):
    forbid_ranks(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.slow  # a profiled training run in a subprocess: about 9 s
def test_quiet_silences_the_profiler(tmp_path):
    argv = tiny_argv(ONE_RANK, quiet=None, profile=tmp_path / "p", profile_steps="2:2")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    run = [sys.executable, "-m", "fastpar.train", *argv]
    loud = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    quiet = subprocess.run([*run, "--quiet"], capture_output=True, text=True, timeout=120, env=env)
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr[-2000:]
    assert "profile: steps 2-2" in loud.stdout
    assert (quiet.stdout, quiet.stderr) == ("", "")
    assert os.path.getsize(tmp_path / "p" / "trace_rank0.json") > 0


def test_named_ranges_are_record_functions_while_profiling():
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, nvtx("fastpar test range"):
        torch.ones(4).sum()
    assert "fastpar test range" in {e.key for e in prof.key_averages()}
    with nvtx("outside any profiler"):  # a no-op
        pass


# -- 8: --profile: Kineto's lines on rank 0 only ------------------------------------------------
@pytest.mark.slow  # two profiled two-rank runs in subprocesses
def test_profiler_lines_only_on_rank_0(tmp_path):
    flags = tiny_argv(ONE_RANK, steps=1, quiet=False, dp=2, batch_size=4, profile=tmp_path / "p")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}

    def kineto_pids(extra: dict) -> set[str]:  # "USDT:<date> <time> <pid>:<tid> File.cpp:52] ..."
        r = run_module("fastpar.train", *flags, env={**env, **extra})
        assert r.returncode == 0, r.stderr[-2000:]
        return {ln.split()[2].split(":")[0] for ln in r.stderr.splitlines() if ".cpp:" in ln}

    assert len(kineto_pids({})) <= 1  # rank 0's lines at most
    assert len(kineto_pids({"KINETO_LOG_LEVEL": "0"})) >= 1  # asked for: every rank's
    for rank in (0, 1):
        assert os.path.getsize(tmp_path / "p" / f"trace_rank{rank}.json") > 0
