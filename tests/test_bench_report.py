"""bench/report.py: markdown tables, one matplotlib chart per comparison plotting what the
benchmarks record side by side (checked on the Axes' data, not pixels), exit code 2 on bad input
or without matplotlib."""

from __future__ import annotations

import ast
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "report.py"
sys.path.insert(0, str(ROOT / "bench"))  # as `python bench/report.py` runs it
report = importlib.import_module("report")
charts = importlib.import_module("report_charts")
plot = importlib.import_module("report_plot")
MiB = 2**20


def _bench(group: str, name: str, params: dict, median: float, extra: dict) -> dict:
    stats = {"min": median * 0.9, "max": median * 1.2, "mean": median, "median": median}
    stats.update(stddev=median * 0.05, rounds=7)
    return {
        "group": group,
        "name": name,
        "fullname": f"bench/test_x.py::{name}",
        "params": params,
        "stats": stats,
        "extra_info": extra,
    }


def _results() -> dict:
    bubble = {
        "1": {"measured": 0.48, "theory": 0.5, "per_rank": [0.5, 0.46]},
        "4": {"measured": 0.21, "theory": 0.2, "per_rank": [0.2, 0.22]},
    }
    return {
        "machine_info": {
            "device": "cpu",
            "torch": "2.9.9+cpu",
            "fastpar": "0.1.0",
            "commit": "abc1234",
            "cpu": {"brand_raw": "Test CPU", "count": 4},
        },
        "commit_info": {"id": "abc1234deadbeef", "dirty": False},
        "datetime": "2026-01-02T03:04:05+00:00",
        "benchmarks": [
            _bench(
                "tp-mlp",
                "test_mlp[256]",
                {"hidden": 256},
                1e-3,
                {
                    "dtensor_over_fastpar": 1.5,
                    "hidden_fraction": 0.42,
                    "seconds": {"fastpar": 0.001, "torch": 0.0025},
                    "peak_memory_bytes": None,
                },
            ),
            _bench(
                "tp-mlp",
                "test_mlp[512]",
                {"hidden": 512},
                4e-3,
                {
                    "dtensor_over_fastpar": 1.25,
                    "hidden_fraction": 0.5,
                    "seconds": {"fastpar": 4e-3},
                },
            ),
            _bench("pipe/bubble", "test_bubble[2]", {"p": 2}, 2e-6, {"bubble": bubble}),
            _bench("pipe/bubble", "test_bubble[4]", {"p": 4}, 5e-7, {"bubble": bubble}),
        ],
    }


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    src = tmp / "cpu-test.json"
    src.write_text(json.dumps(_results()))
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
    a.write_text(json.dumps(_results()))
    b.write_text(json.dumps(_results()))
    assert report.main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| file | name | params | median |" in md and "| b | test_mlp[512] |" in md
    assert "(tp-mlp-a.png)" in md and "(tp-mlp-b.png)" in md
    both = report.load_run(a), report.load_run(b)
    both[1].label = "b"
    notes = {c.name: c.note for c in charts.build_charts(list(both), report._note)}
    assert "a.json" in notes["tp-mlp-a.png"] and "b.json" not in notes["tp-mlp-a.png"]
    assert "b.json" in notes["tp-mlp-b.png"] and "a.json" not in notes["tp-mlp-b.png"]


# --------------------------------------------------------------------------------------------
# What each chart plots: a synthetic file shaped like each benchmark's records


def _chart_results() -> dict:
    bubble = {  # out of order on purpose: plotted over m = 1, 2, 4
        "4": {"measured": 0.19, "theory": 0.2, "per_rank": [0.26, 0.12]},
        "1": {"measured": 0.41, "theory": 0.5, "per_rank": [0.55, 0.28]},
        "2": {"measured": 0.29, "theory": 1 / 3, "per_rank": [0.37, 0.2]},
    }
    held = {"params": 3 * MiB, "grads": 3 * MiB, "optimizer": 1.5 * MiB}
    zero = [
        ("test_zero_memory[1]", {"stage": 1}, {"stage": 1}, 7.5 * MiB, 7.25 * MiB, "two"),
        ("test_zero_memory_stage3", None, {"stage": 3}, 3 * MiB, 2.75 * MiB, "three"),
    ]
    z3 = {"fastpar-zero3": 8 * MiB, "torch-fsdp2": 8 * MiB + 16}
    kernels = [("N1M", "fastpar", 3.8e-3), ("N1M", "torch_fused", 9.7e-4)]
    kernels += [("N1M", "torch_foreach", 2.5e-3), ("N10M", "fastpar", 0.118)]
    kernels += [("N10M", "torch_foreach", 0.0436)]  # no torch_fused at 10M
    return {
        "machine_info": {"device": "cpu", "torch": "2.13.0+cpu", "commit": "abc1234"},
        "benchmarks": [
            # multi-rank rounds of 3.24 s and 4.5 s (rank start-up included): not plotted
            _bench(
                "tp-mlp-2-ranks",
                "test_mlp[256-2]",
                {"hidden": 256, "world": 2},
                3.24,
                {"fastpar_ms": 23.0, "dtensor_ms": 29.0, "dtensor_over_fastpar": 29 / 23},
            ),
            _bench(
                "tp-mlp-4-ranks",
                "test_mlp[256-4]",
                {"hidden": 256, "world": 4},
                4.5,
                {"fastpar_ms": 40.0, "dtensor_ms": 50.0, "dtensor_over_fastpar": 1.25},
            ),
            _bench(
                "zero3-vs-fsdp2-2",
                "test_zero3[2]",
                {"world": 2},
                0.96,
                {
                    "seconds": {"fastpar-zero3": 0.0376, "torch-fsdp2": 0.0465},
                    "bytes_per_rank": z3,
                    "peer_time_over_fastpar": 0.0465 / 0.0376,
                    "sent_bytes": 6 * MiB,
                    "three_psi_bytes": 6 * MiB,
                },
            ),
            _bench(
                "pipeline-bubble-1f1b",
                "test_bubble_table[2-1f1b]",
                {"p": 2, "schedule": "1f1b"},
                2.0,
                {"bubble": bubble},
            ),
            _bench(
                "pipeline-activation-memory",
                "test_activation_memory[gpipe-False]",
                {"schedule": "gpipe", "recompute": False},
                0.34,
                {"peak_bytes_per_rank": [9 * MiB, 17 * MiB]},
            ),
            _bench(
                "pipeline-activation-memory",
                "test_activation_memory[gpipe-True]",
                {"schedule": "gpipe", "recompute": True},
                0.33,
                {"peak_bytes_per_rank": [64 * 1024, 64 * 1024]},
            ),
            *[
                _bench(
                    "zero-memory-planned-vs-measured",
                    name,
                    params,
                    0.35,
                    {
                        **extra,
                        "held": {**held, "total": total},
                        "planned_total": plan,
                        "sent_bytes": 4.5 * MiB,
                        f"{k}_psi_bytes": 4.5 * MiB,
                    },
                )
                for name, params, extra, total, plan, k in zero
            ],
            *[
                _bench(
                    f"adamw-{size}",
                    f"test_adamw_step[{prov}-{size}]",
                    {"provider": prov, "numel": 10**6},
                    median,
                    {"provider": prov},
                )
                for size, prov, median in kernels
            ],
            _bench(
                "train-step",
                "test_train_step_throughput[dp8]",
                {"name": "dp8"},
                1.37,
                {"step_seconds": 0.1415, "tokens_per_second": 7234.0, "layout": "dp8"},
            ),
            _bench(
                "train-step",
                "test_train_step_throughput[pp4]",
                {"name": "pp4"},
                1.22,
                {"step_seconds": 0.115, "tokens_per_second": 8894.0, "layout": "pp4"},
            ),
            _bench("harness-2-ranks", "test_fork_noop[2]", {"world": 2}, 0.07, {}),
            _bench("harness-2-ranks", "test_spawn_tp1_mesh[2]", {"world": 2}, 1.36, {}),
            _bench("harness-4-ranks", "test_fork_noop[4]", {"world": 4}, 0.1, {}),
        ],
    }


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Chart file name -> its matplotlib Figure, from the synthetic file."""
    src = tmp_path_factory.mktemp("charts") / "cpu-charts.json"
    src.write_text(json.dumps(_chart_results()))
    built = charts.build_charts([report.load_run(src)], report._note)
    return {c.name: plot.draw(c) for c in built}


def _bars(ax) -> dict[str, list[float]]:
    """Series label -> bar heights, as the Axes holds them."""
    return {c.get_label(): [r.get_height() for r in c] for c in ax.containers}


def _ticks(ax) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def _texts(fig) -> str:
    return "\n".join(t.get_text() for t in fig.texts)


def test_one_chart_per_comparison(figures: dict) -> None:
    assert sorted(figures) == [
        "adamw.png",
        "harness.png",
        "pipeline-activation-memory.png",
        "pipeline-bubble.png",
        "tp-mlp.png",
        "train-step.png",
        "zero-memory-planned-vs-measured.png",
        "zero3-vs-fsdp2.png",
    ]
    for fig in figures.values():  # the footer names the file and the device, no other file
        assert "cpu-charts.json · device cpu" in _texts(fig)


def test_side_by_side_step_times_not_the_round_median(figures: dict) -> None:
    fig = figures["tp-mlp.png"]  # both groups (2 and 4 ranks) in one chart
    (ax,) = fig.axes
    assert "tp-mlp: fastpar vs dtensor" in _texts(fig)
    assert ax.get_ylabel() == "time per step (ms)"
    assert _bars(ax) == {
        "fastpar": pytest.approx([23.0, 40.0]),
        "dtensor": pytest.approx([29.0, 50.0]),
    }
    assert _legend(ax) == ["fastpar", "dtensor"]
    assert _ticks(ax) == [
        "world=2\ndtensor / fastpar = 1.26×",
        "world=4\ndtensor / fastpar = 1.25×",
    ]


def test_peer_chart_has_both_providers_bytes_and_traffic(figures: dict) -> None:
    time, held, sent = figures["zero3-vs-fsdp2.png"].axes
    assert _bars(time) == {
        "fastpar-zero3": pytest.approx([37.6]),
        "torch-fsdp2": pytest.approx([46.5]),
    }
    assert _ticks(time) == ["fastpar-zero3", "torch-fsdp2"]  # one category: bars named
    assert held.get_ylabel() == "bytes (MiB)"
    assert _bars(held) == {
        "fastpar-zero3": pytest.approx([8.0]),
        "torch-fsdp2": pytest.approx([8 + 16 / MiB]),
    }
    assert _bars(sent) == {
        "fastpar (measured)": pytest.approx([6.0]),
        "theory": pytest.approx([6.0]),
    }
    assert "3(N−1)/N·Ψ" in sent.get_xlabel()
    colour = {c.get_label(): c.patches[0].get_facecolor() for c in (*time.containers,)}
    for c in held.containers:  # one colour per provider in every panel
        assert c.patches[0].get_facecolor() == colour[c.get_label()]


def test_bubble_measured_against_theory_over_m(figures: dict) -> None:
    (ax,) = figures["pipeline-bubble.png"].axes
    assert ax.get_title() == "pipeline-bubble-1f1b"
    assert ax.get_ylabel() == "idle fraction (bubble) (%)"
    assert ax.get_xlabel() == "micro-batches m"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["p=2, schedule=1f1b measured", "p=2, schedule=1f1b theory"]
    measured, theory = lines.values()
    assert list(measured.get_xdata()) == [1.0, 2.0, 4.0]
    assert list(measured.get_ydata()) == pytest.approx([41.0, 29.0, 19.0])
    assert list(theory.get_ydata()) == pytest.approx([50.0, 100 / 3, 20.0])
    assert theory.get_linestyle() == "--" and measured.get_linestyle() == "-"
    assert _legend(ax) == list(lines)


def test_per_rank_bytes(figures: dict) -> None:
    (ax,) = figures["pipeline-activation-memory.png"].axes
    assert ax.get_ylabel() == "peak bytes per rank (MiB)"
    assert _ticks(ax) == ["rank 0", "rank 1"]
    assert _bars(ax) == {
        "recompute=False": pytest.approx([9.0, 17.0]),
        "recompute=True": pytest.approx([1 / 16, 1 / 16]),
    }


def test_planned_against_measured_and_traffic_against_theory(figures: dict) -> None:
    held, sent = figures["zero-memory-planned-vs-measured.png"].axes
    assert _ticks(held) == ["stage=1", "stage=3"]  # stage 3 has no params: from extra_info
    assert _bars(held) == {
        "measured (held)": pytest.approx([7.5, 3.0]),
        "planned": pytest.approx([7.25, 2.75]),
    }
    assert _ticks(sent) == ["stage=1\ntheory 2(N−1)/N·Ψ·4 B", "stage=3\ntheory 3(N−1)/N·Ψ·4 B"]
    four_and_a_half = pytest.approx([4.5, 4.5])
    assert _bars(sent) == {"fastpar (measured)": four_and_a_half, "theory": four_and_a_half}


def test_kernels_one_panel_per_size_providers_side_by_side(figures: dict) -> None:
    small, large = figures["adamw.png"].axes
    assert (small.get_title(), large.get_title()) == ("N1M", "N10M")
    assert small.get_ylabel() == "time per call (median) (ms)"
    assert _bars(small) == {
        "fastpar": pytest.approx([3.8]),
        "torch_fused": pytest.approx([0.97]),
        "torch_foreach": pytest.approx([2.5]),
    }
    assert _bars(large) == {"fastpar": pytest.approx([118]), "torch_foreach": pytest.approx([43.6])}
    assert _ticks(small) == ["fastpar", "torch_fused", "torch_foreach"]
    assert _ticks(large) == ["fastpar", "torch_foreach"]
    colours = [
        {c.get_label(): c.patches[0].get_facecolor() for c in ax.containers}
        for ax in (small, large)
    ]
    assert len(set(colours[0].values())) == 3  # one colour per provider, the same in each panel
    assert colours[1] == {k: colours[0][k] for k in ("fastpar", "torch_foreach")}


def test_single_figures_and_the_median_fallback(figures: dict) -> None:
    time, rate = figures["train-step.png"].axes
    assert time.get_ylabel() == "step time (ms)"
    assert _ticks(time) == ["name=dp8", "name=pp4"]
    assert list(_bars(time).values()) == [pytest.approx([141.5, 115.0])]
    assert rate.get_ylabel() == "tokens per second (tokens/s)"
    assert list(_bars(rate).values()) == [pytest.approx([7234.0, 8894.0])]
    # the harness records no side-by-side numbers: its round (rank start-up) is the figure
    (ax,) = figures["harness.png"].axes
    assert ax.get_ylabel() == "time per round (s)"
    assert _ticks(ax) == ["fork_noop", "spawn_tp1_mesh"]
    bars = _bars(ax)
    assert list(bars) == ["2-ranks", "4-ranks"] and bars["2-ranks"] == pytest.approx([0.07, 1.36])
    assert bars["4-ranks"][0] == pytest.approx(0.1) and math.isnan(bars["4-ranks"][1])


def test_main_writes_a_png_per_chart_linked_from_the_report(tmp_path: Path) -> None:
    src = tmp_path / "cpu-charts.json"
    src.write_text(json.dumps(_chart_results()))
    assert report.main([str(src), "--out", str(tmp_path / "out")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert len(pngs) == 8
    md = (tmp_path / "out" / "report.md").read_text()
    for name in pngs:
        data = (tmp_path / "out" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in md
    # after the last table of its family
    assert md.index("## tp-mlp-4-ranks") < md.index("(tp-mlp.png)") < md.index("## train-step")


def test_without_matplotlib_one_line_error_or_markdown_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "in.json"
    src.write_text(json.dumps(_results()))
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
    src.write_text(json.dumps(_results()))
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
