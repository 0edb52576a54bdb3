"""Drawing the charts of ``bench/report_charts.py`` with matplotlib (the optional ``bench`` extra:
``pip install fastpar[bench]``), on the Agg canvas: no display, no pyplot state.

``draw(chart)`` returns a Figure with one Axes per panel, in order: grouped bars (one container
per series, labelled) or lines over ``panel.x``, the y axis in a readable unit (ms, MiB, %, ...),
a legend, the chart's title and its footer. ``save`` writes it as a PNG.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from report_charts import BYTE_UNITS, TIME_UNITS, Chart, Panel, Series, sig3

# matplotlib's tab10 less its grey, which is kept for theory / planned values
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
)
THEORY_COLOUR = "#7f7f7f"
MAX_BAR_LABELS = 40  # bars per panel that still get their value written above them


def display_unit(unit: str, values: Iterable[float | None]) -> tuple[float, str]:
    """(factor, label) that shows ``values`` (base units) in a readable unit: ms, MiB, %, ..."""
    if unit == "fraction":
        return 100.0, "%"
    table = {"s": TIME_UNITS, "B": BYTE_UNITS}.get(unit)
    if table is None:
        return 1.0, unit
    top = max((abs(v) for v in values if v is not None), default=0.0)
    label, scale = next(((u, s) for u, s in table if top >= s), table[-1])
    return 1.0 / scale, label


def _value(h: float) -> str:
    """A bar's value as written above it: 3 significant digits, no exponent below 10^6."""
    if math.isnan(h):
        return ""
    return f"{h:,.0f}" if 1000 <= abs(h) < 1e6 else sig3(h)


def _colour(s: Series) -> str:
    return THEORY_COLOUR if s.colour < 0 else PALETTE[s.colour % len(PALETTE)]


def _draw_panel(ax: Any, panel: Panel) -> None:
    factor, unit = display_unit(panel.unit, (v for s in panel.series for v in s.values))
    scaled = [[math.nan if v is None else v * factor for v in s.values] for s in panel.series]
    n = max(1, len(panel.series))
    # one category (a kernel size): the providers name the bars, no legend needed
    single = panel.x is None and len(panel.categories) == 1 and n > 1
    if panel.x is not None:
        for s, ys in zip(panel.series, scaled, strict=True):
            style = {"linestyle": "--", "marker": ""} if s.dashed else {"marker": "o"}
            ax.plot(panel.x, ys, color=_colour(s), label=s.label, **style)
        if all(x > 0 for x in panel.x):  # micro-batch counts: 1, 2, 4, ... evenly spaced
            ax.set_xscale("log", base=2)
        ax.set_xticks(panel.x, panel.categories)
        ax.minorticks_off()
    else:
        width = 0.7 if single else 0.8 / n
        labelled = n * len(panel.categories) <= MAX_BAR_LABELS
        for i, (s, hs) in enumerate(zip(panel.series, scaled, strict=True)):
            xs = [i] if single else [c - 0.4 + width * (i + 0.5) for c in range(len(hs))]
            bars = ax.bar(xs, hs, width * 0.95, label=s.label, color=_colour(s))
            if labelled:
                ax.bar_label(bars, labels=[_value(h) for h in hs], fontsize=7, padding=2)
        if single:
            ax.set_xticks(range(n), [s.label for s in panel.series], fontsize=8)
            ax.set_xlabel(panel.categories[0], fontsize=8)
        else:
            ax.set_xticks(range(len(panel.categories)), panel.categories, fontsize=8)
        if any(h < 0 for hs in scaled for h in hs):
            ax.axhline(0, color="0.3", linewidth=0.8)
        ax.margins(y=0.15)
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(f"{panel.quantity} ({unit})" if unit else panel.quantity)
    if panel.xlabel:
        ax.set_xlabel(panel.xlabel)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if panel.series and not single:
        ax.legend(fontsize=8)


def _size(chart: Chart) -> tuple[float, float]:
    """Figure inches: wide enough for every bar and tick label, a row per stacked panel."""
    n = len(chart.panels)
    if chart.grid:
        cols = min(4, n)
        return 4.4 * cols, 3.6 * math.ceil(n / cols) + 0.9
    cats = max((len(p.categories) for p in chart.panels), default=1)
    bars = max((len(p.categories) * max(1, len(p.series)) for p in chart.panels), default=1)
    lines = max((c.count("\n") + 1 for p in chart.panels for c in p.categories), default=1)
    return min(22.0, max(8.0, 2 + 0.3 * bars + 0.5 * cats)), n * (3.0 + 0.17 * lines) + 0.9


def draw(chart: Chart) -> Any:
    """The chart as a matplotlib Figure, one Axes per panel (in ``chart.panels`` order)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(chart.panels)
    cols = min(4, n) if chart.grid else 1
    rows = math.ceil(n / cols)
    fig = Figure(figsize=_size(chart), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, panel in zip(axes, chart.panels, strict=False):
        _draw_panel(ax, panel)
    for ax in axes[n:]:
        fig.delaxes(ax)
    fig.suptitle(chart.title, fontsize=12, fontweight="bold")
    if chart.note:
        fig.supxlabel(chart.note, fontsize=8, color="0.35")
    return fig


def save(chart: Chart, path: Path) -> None:
    """Write the chart as a PNG."""
    draw(chart).savefig(path, dpi=100)
