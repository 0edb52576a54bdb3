"""The charts of bench/report.py (``report_charts``, drawn by ``report_plot``): one matplotlib
chart per comparison, plotting what the benchmarks record side by side, checked on the Axes'
data, not pixels, from a synthetic file shaped like each benchmark's records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _bench_report import MiB, bench, charts, plot, report


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
            bench(
                "tp-mlp-2-ranks",
                "test_mlp[256-2]",
                {"hidden": 256, "world": 2},
                3.24,
                {"fastpar_ms": 23.0, "dtensor_ms": 29.0, "dtensor_over_fastpar": 29 / 23},
            ),
            bench(
                "tp-mlp-4-ranks",
                "test_mlp[256-4]",
                {"hidden": 256, "world": 4},
                4.5,
                {"fastpar_ms": 40.0, "dtensor_ms": 50.0, "dtensor_over_fastpar": 1.25},
            ),
            bench(
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
            bench(
                "pipeline-bubble-1f1b",
                "test_bubble_table[2-1f1b]",
                {"p": 2, "schedule": "1f1b"},
                2.0,
                {"bubble": bubble},
            ),
            bench(
                "pipeline-activation-memory",
                "test_activation_memory[gpipe-False]",
                {"schedule": "gpipe", "recompute": False},
                0.34,
                {"peak_bytes_per_rank": [9 * MiB, 17 * MiB]},
            ),
            bench(
                "pipeline-activation-memory",
                "test_activation_memory[gpipe-True]",
                {"schedule": "gpipe", "recompute": True},
                0.33,
                {"peak_bytes_per_rank": [64 * 1024, 64 * 1024]},
            ),
            *[
                bench(
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
                bench(
                    f"adamw-{size}",
                    f"test_adamw_step[{prov}-{size}]",
                    {"provider": prov, "numel": 10**6},
                    median,
                    {"provider": prov},
                )
                for size, prov, median in kernels
            ],
            bench(
                "train-step",
                "test_train_step_throughput[dp8]",
                {"name": "dp8"},
                1.37,
                {"step_seconds": 0.1415, "tokens_per_second": 7234.0, "layout": "dp8"},
            ),
            bench(
                "train-step",
                "test_train_step_throughput[pp4]",
                {"name": "pp4"},
                1.22,
                {"step_seconds": 0.115, "tokens_per_second": 8894.0, "layout": "pp4"},
            ),
            bench("harness-2-ranks", "test_fork_noop[2]", {"world": 2}, 0.07, {}),
            bench("harness-2-ranks", "test_spawn_tp1_mesh[2]", {"world": 2}, 1.36, {}),
            bench("harness-4-ranks", "test_fork_noop[4]", {"world": 4}, 0.1, {}),
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
