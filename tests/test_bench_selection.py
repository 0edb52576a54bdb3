"""``pytest bench/``'s quick default selection and its 100-column table, checked without running
a benchmark (docs/benchmarks.md): every name in bench/conftest.py's ``QUICK`` is a collected
benchmark, every benchmark file keeps a case, ``-m full`` and ``FASTPAR_BENCH_FULL=1`` give the
rest and everything, and pytest-benchmark's table under the defaults fits 100 columns."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

ROOT = Path(__file__).resolve().parents[1]


def _conftest():
    spec = importlib.util.spec_from_file_location("bench_conftest", ROOT / "bench" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _collect(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "FASTPAR_BENCH_FULL"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "bench/",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_quick_selection_keeps_a_case_of_every_file_and_the_rest_is_marked_full():
    quick_table = _conftest().QUICK
    quick, rest = _collect(), _collect("-m", "full")
    everything = quick + rest
    files = {p.name for p in (ROOT / "bench").glob("test_*.py")}
    assert set(quick_table) == files, "QUICK names a case of every benchmark file, and no other"
    assert {n.split("::")[0].removeprefix("bench/") for n in quick} == files
    named = {f"bench/{f}::{name}" for f, names in quick_table.items() for name in names}
    assert set(quick) == named, f"not a benchmark: {sorted(named - set(quick))}"
    assert not set(quick) & set(rest)
    assert len(quick) <= len(everything) // 4, "the quick run should stay small"


@pytest.mark.parametrize(
    "env,markexpr,args,everything",
    [
        (None, "", ["bench/"], False),
        ("1", "", ["bench/"], True),
        ("0", "", ["bench/"], False),
        (None, "full", ["bench/"], True),  # -m decides alone
        (None, "", ["bench/test_bench_zero3.py::test_zero3_against_fsdp2[4]"], True),
    ],
)
def test_what_asks_for_more_than_the_quick_set(env, markexpr, args, everything, monkeypatch):
    conftest = _conftest()
    if env is None:
        monkeypatch.delenv(conftest.FULL_ENV, raising=False)
    else:
        monkeypatch.setenv(conftest.FULL_ENV, env)

    class Config:
        def getoption(self, name):
            assert name == "markexpr"
            return markexpr

    config = Config()
    config.args = args
    assert conftest._everything(config) is everything


def test_the_table_fits_100_columns():
    from pytest_benchmark.plugin import pytest_benchmark_scale_unit
    from pytest_benchmark.table import TableResults
    from pytest_benchmark.utils import report_noprogress

    conftest = _conftest()
    longest = "test_moe_grouped_experts[cuda-E16-H1024-F2048-T16384-balanced-swiglu]"
    benches = []
    for i, name in enumerate([longest, "test_fork_noop[2]"]):
        t = 1.234567 * (1 + 50 * i)
        stats = dict(min=t, max=9 * t, mean=2 * t, median=1.5 * t, iqr=t, stddev=t, ops=1 / t)
        benches.append(
            dict(
                stats,
                name=name,
                fullname=name,
                source=None,
                outliers="1;2",
                rounds=123,
                iterations=1,
            )
        )
    assert conftest.short_name(benches[0]).startswith("moe_grouped")
    assert len(conftest.short_name(benches[0])) == conftest.NAME_WIDTH

    lines: list[str] = []

    class Reporter:
        def write_line(self, line, **kw):
            lines.append(str(line) + "\n")

        def write(self, text, **kw):
            parts = (lines.pop() if lines and not lines[-1].endswith("\n") else "") + text
            lines.extend(parts.splitlines(keepends=True) or [""])

        def ensure_newline(self):
            pass

    table = TableResults(
        columns=conftest.COLUMNS,
        sort="min",
        histogram=False,
        name_format=conftest.short_name,
        logger=None,
        scale_unit=lambda **kw: pytest_benchmark_scale_unit(config=None, **kw),
    )
    table.display(conftest._Fitted(Reporter()), [("a group", benches)], report_noprogress)
    widths = [len(line.rstrip("\n")) for line in lines]
    assert any("median" in line.lower() for line in lines), lines
    assert max(widths) <= conftest.WIDTH, [line for line in lines if len(line.rstrip()) > 100]
