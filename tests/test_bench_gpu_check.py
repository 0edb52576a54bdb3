"""bench/gpu_check.py, the one script a GPU lease runs: its phases, budget and output files,
run here on the CPU with torch told that a GPU is present (the subprocesses it starts see the
real machine, so the GPU tests skip and the benchmarks take their CPU paths)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_kernel_benchmarks_run_first_and_every_file_exists():
    files = gpu_check.bench_files(everything=True)
    assert files[: len(gpu_check.KERNEL_BENCHES)] == gpu_check.KERNEL_BENCHES
    assert len(files) == len(set(files)) and not any("harness" in f for f in files)
    for f in files:
        assert (ROOT / "bench" / f).is_file(), f


def test_merge_keeps_every_benchmark():
    a = {"machine_info": {"device": "x"}, "benchmarks": [{"name": "a"}]}
    b = {"machine_info": {"device": "y"}, "benchmarks": [{"name": "b"}, {"name": "c"}]}
    merged = gpu_check.merge([a, None, b])
    assert merged["machine_info"] == {"device": "x"}
    assert [x["name"] for x in merged["benchmarks"]] == ["a", "b", "c"]
    assert gpu_check.merge([None]) is None


@pytest.mark.slow  # two pytest runs in subprocesses: about 25 s
def test_the_check_runs_its_phases_and_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU (pretended)")
    monkeypatch.setattr(gpu_check, "KERNEL_BENCHES", ["test_bench_adamw.py", "no_such_file.py"])
    # one file of GPU tests (they skip here: the pretence does not reach the subprocess), not
    # the whole suite's collection
    monkeypatch.setattr(gpu_check, "GPU_TESTS", ["tests/test_kernels_adamw.py"])
    quick = ["--benchmark-max-time=0.001", "--benchmark-min-rounds=1", "--benchmark-warmup=off"]
    monkeypatch.setattr(gpu_check, "BENCH_OPTIONS", quick)  # the phases, not the timings
    assert gpu_check.main([str(tmp_path), "--budget", "400"]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["bench.json", "bench.log", "results.json", "results.md", "tests.log"]
    result = json.loads((tmp_path / "results.json").read_text())
    status = result["status"]
    assert status["install"] == "already importable, skipped"
    assert status["gpu tests"].startswith("passed")
    assert status["bench test_bench_adamw.py"].startswith("ok")
    assert status["bench no_such_file.py"].startswith("exit 4")  # pytest: no such file
    names = [b["name"] for b in result["benchmarks"]]
    assert names and all("test_bench_adamw.py" in n for n in names)
    assert "test_adamw_step" in (tmp_path / "results.md").read_text()


def test_an_exhausted_budget_skips_the_benchmarks(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU (pretended)")
    monkeypatch.setattr(gpu_check, "TEST_LIMIT_S", 0.5)
    assert gpu_check.main([str(tmp_path), "--budget", "1"]) == 1  # the GPU tests timed out
    status = json.loads((tmp_path / "results.json").read_text())["status"]
    assert status["gpu tests"].startswith("TIMED OUT")
    assert all(status[f"bench {f}"].startswith("not run") for f in gpu_check.KERNEL_BENCHES)
