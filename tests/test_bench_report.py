"""bench/report.py: markdown tables (a header, groups, medians, ratio columns), its formatting,
exit code 2 on bad input or without matplotlib, where it writes; fastpar never imports
matplotlib, and git keeps the runs and reports out. What each chart plots:
tests/test_bench_report_charts.py."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _bench_report import ROOT, SCRIPT, charts, report, results


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    src = tmp / "cpu-test.json"
    src.write_text(json.dumps(results()))
    out = tmp / "out"
    assert report.main([str(src), "--out", str(out)]) == 0
    return out


def test_markdown_has_header_groups_medians_and_ratio_columns(rendered: Path) -> None:
    md = (rendered / "report.md").read_text()
    for s in ("cpu", "2.9.9+cpu", "0.1.0", "abc1234", "2026-01-02", "How to read"):
        assert s in md
    assert "## tp-mlp" in md and "## pipe/bubble" in md
    assert "| 1.00 ms |" in md and "| 4.00 ms |" in md  # medians with units
    assert "| 2.00 µs |" in md and "| 500 ns |" in md
    header = next(line for line in md.splitlines() if line.startswith("| name | params | median"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:6] == [
        "name",
        "params",
        "median",
        "rounds",
        "dtensor / fastpar",
        "hidden_fraction",
    ]
    assert "seconds.fastpar" in cols and "seconds.torch" in cols
    assert "peak_memory_bytes" not in cols  # never measured: no column
    assert "| 1.50× | 42.0 % | 1.00 ms | 2.50 ms |" in md
    assert "| 1.25× | 50.0 % | 4.00 ms | — |" in md
    # the dict-of-dicts `bubble` entry: its own table, one row per (benchmark, key)
    assert "| name | params | bubble | measured | theory | per_rank |" in md
    assert "| test_bubble[2] | p=2 | 4 | 0.21 | 0.2 | 0.2, 0.22 |" in md
    assert "(tp-mlp.png)" in md and "(pipe_bubble.png)" in md


def test_formatting() -> None:
    assert report.fmt_time(1.5) == "1.50 s"
    assert report.fmt_time(0.0123) == "12.3 ms"
    assert report.fmt_time(4.56e-5) == "45.6 µs"
    assert report.fmt_time(7e-9) == "7.00 ns"
    assert report.fmt_time(None) == "—"
    assert report.fmt_value("bytes_per_rank.zero1", 3 * 2**20) == "3.00 MiB"
    assert report.fmt_value("bytes_per_s", 2.5e11) == "250 GB/s"
    assert report.fmt_value("fastpar_ms", 12.5) == "12.5 ms"
    assert report.header_for("peer_time_over_fastpar") == "peer_time / fastpar"


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such file"),
        ("{not json", "invalid JSON"),
        ('{"machine_info": {}}', "not a pytest-benchmark JSON file"),
    ],
)
def test_bad_input_exits_2(tmp_path: Path, content: str | None, message: str) -> None:
    src = tmp_path / "in.json"
    if content is not None:
        src.write_text(content)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(src), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert message in out.stderr and str(src) in out.stderr
    assert not (tmp_path / "out").exists()


def test_two_inputs_get_a_file_column_and_a_chart_each(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(results()))
    b.write_text(json.dumps(results()))
    assert report.main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| file | name | params | median |" in md and "| b | test_mlp[512] |" in md
    assert "(tp-mlp-a.png)" in md and "(tp-mlp-b.png)" in md
    both = report.load_run(a), report.load_run(b)
    both[1].label = "b"
    notes = {c.name: c.note for c in charts.build_charts(list(both), report._note)}
    assert "a.json" in notes["tp-mlp-a.png"] and "b.json" not in notes["tp-mlp-a.png"]
    assert "b.json" in notes["tp-mlp-b.png"] and "a.json" not in notes["tp-mlp-b.png"]


def test_without_matplotlib_one_line_error_or_markdown_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "in.json"
    src.write_text(json.dumps(results()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    assert report.main([str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install fastpar[bench]" in err and "--no-charts" in err
    assert not (tmp_path / "out").exists()
    assert report.main([str(src), "--out", str(tmp_path / "out"), "--no-charts"]) == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["report.md"]


def test_fastpar_never_imports_matplotlib() -> None:
    for path in (ROOT / "fastpar").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.split(".")[0] == "matplotlib" for n in names), path


def test_without_out_the_report_goes_to_the_default_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert report.DEFAULT_OUT == ROOT / "bench" / "results" / "report"
    src = tmp_path / "in.json"
    src.write_text(json.dumps(results()))
    monkeypatch.setattr(report, "DEFAULT_OUT", tmp_path / "default")  # not the checkout's folder
    assert report.main([str(src), "--no-charts"]) == 0
    assert [p.name for p in (tmp_path / "default").iterdir()] == ["report.md"]


def test_runs_and_reports_stay_out_of_git() -> None:
    """Git ignores what bench/results/ gets (a run's JSON, the report and its charts) but its
    README, and tracks nothing else there: the figures live in bench/RESULTS.md."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)

    outputs = ["cpu-x.json", "report/report.md", "report/tp-mlp.png"]
    for path in (f"bench/results/{name}" for name in outputs):
        assert git("check-ignore", "-q", "--no-index", path).returncode == 0, path
    assert git("check-ignore", "-q", "--no-index", "bench/results/README.md").returncode == 1
    assert git("ls-files", "bench/results").stdout.split() == ["bench/results/README.md"]
    assert (ROOT / "bench" / "RESULTS.md").is_file()
