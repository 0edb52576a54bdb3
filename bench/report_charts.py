"""The charts of ``bench/report.py``: what each one plots.

One chart is one comparison: the benchmarks of one family (groups that differ only by a size or
a variant, see ``family``) in one input file. What it plots is what those benchmarks record side
by side in ``extra_info``, never the pytest-benchmark median of a multi-rank round (which
includes starting the ranks):

- ``seconds`` = {provider: seconds per step} or ``<provider>_ms`` fields: each provider's time
  per step as bars side by side, with the recorded time ratio under each category; the bytes of
  each provider (``bytes_per_rank`` = {provider: bytes}, or a bytes field ending in a provider's
  name); the ``*_fraction`` fields; bytes sent against theory (``sent_bytes`` beside
  ``<k>_psi_bytes``);
- ``bubble`` tables ({m: {measured, theory}}): measured idle fraction and theory, lines over m;
- ``*per_rank`` lists: one bar per rank and benchmark;
- ``held`` beside ``planned_total``: bytes held per rank against the planner, bytes sent against
  theory;
- kernels (a ``provider`` param; pytest-benchmark times one call a round): each provider's
  median time per call, one panel per group;
- ``*_seconds`` / ``*_per_second`` figures: one bar per benchmark and figure;
- anything else: the median of a round (the harness, whose round is the start-up it measures).

Values stay in base units (seconds, bytes, fractions); ``report_plot.py`` draws the charts with
matplotlib and picks the display units. This file needs nothing beyond the standard library.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))  # largest first
BYTE_UNITS = (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0))

# Groups whose name starts with one of these (then "-") are one family; any other group's family
# is its name less a trailing world size ("tp-mlp-2-ranks" and "dp-fastpar-ddp-4" -> "tp-mlp",
# "dp-fastpar-ddp").
FAMILIES = (
    "adamw",
    "cross_entropy",
    "fp8_quantize",
    "moe_permute",
    "moe_unpermute",
    "unscale_norm",
    "moe-layer",
    "moe-overlap",
    "pipeline-bubble",
    "pipeline-vs-torch",
)


def sig3(x: float) -> str:
    """Three significant digits, trailing zeros kept (1.00, 12.3, 123, 1234)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def family(group: str) -> str:
    """The comparison a benchmark group belongs to (see ``FAMILIES``)."""
    for f in FAMILIES:
        if group == f or group.startswith(f + "-"):
            return f
    return re.sub(r"-\d+(-ranks)?$", "", group) or group


def chart_filename(name: str) -> str:
    """A safe PNG file name for a chart."""
    return (re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "chart") + ".png"


@dataclass
class Series:
    """One provider (or measured / theory): a value per category, None where not recorded."""

    label: str
    values: list[float | None]
    colour: int = 0
    dashed: bool = False  # theory lines


@dataclass
class Panel:
    """One matplotlib Axes: bars side by side per category, or lines over ``x``."""

    title: str
    quantity: str  # what the y axis measures ("time per step")
    unit: str  # "s", "B", "fraction", or a unit written as it is ("tokens/s")
    categories: list[str]
    series: list[Series]
    x: list[float] | None = None  # lines over these x values (categories are their tick labels)
    xlabel: str = ""


@dataclass
class Chart:
    """One PNG: a title, a footer naming the input file, panels stacked or in a grid."""

    name: str
    title: str
    note: str
    groups: list[str]
    panels: list[Panel]
    grid: bool = False  # panels with their own categories, in a grid (else stacked, shared)


# --------------------------------------------------------------------------------------------
# Reading what the benchmarks record


def _num(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _extra(b: dict[str, Any]) -> dict[str, Any]:
    e = b.get("extra_info")
    return e if isinstance(e, dict) else {}


def _params(b: dict[str, Any]) -> dict[str, Any]:
    p = b.get("params")
    return p if isinstance(p, dict) else {}


def _ordered(names: Iterable[str]) -> list[str]:
    """Distinct names in first-seen order, fastpar's first."""
    return sorted(dict.fromkeys(names), key=lambda n: not n.startswith("fastpar"))


def _labels(
    items: list[dict[str, Any]], skip: tuple[str, ...] = (), whole: bool = False
) -> list[str]:
    """A category label per benchmark: the params that differ between them (a param a benchmark
    lacks is looked up in its extra_info), else the test names if they differ, else all params
    (``whole``) or nothing."""
    keys = [k for k in dict.fromkeys(k for b in items for k in _params(b)) if k not in skip]
    vals = [{k: _params(b).get(k, _extra(b).get(k)) for k in keys} for b in items]
    varying = [k for k in keys if len({repr(v[k]) for v in vals}) > 1]
    names = [str(b.get("name", "?")).split("[")[0].removeprefix("test_") for b in items]
    if not varying and len(set(names)) > 1:
        return names
    shown = varying or (keys if whole else [])
    return ["\n".join(f"{k}={v[k]}" for k in shown) for v in vals]


def _times(b: dict[str, Any]) -> dict[str, float]:
    """{provider: seconds per step} measured side by side (empty when fewer than two)."""
    e = _extra(b)
    sec = e.get("seconds")
    if isinstance(sec, dict):
        out = {str(k): _num(v) for k, v in sec.items() if _num(v) is not None}
        if len(out) >= 2:
            return out  # type: ignore[return-value]
    ms = {k[:-3]: _num(v) for k, v in e.items() if k.endswith("_ms") and _num(v) is not None}
    return {k: v / 1e3 for k, v in ms.items() if v is not None} if len(ms) >= 2 else {}


def _time_ratio(b: dict[str, Any]) -> str:
    """The first recorded time ratio (``a_over_b``), as ``a / b = 1.17×``."""
    for k, v in _extra(b).items():
        if "_over_" in k and "bytes" not in k and _num(v) is not None:
            return f"{k.replace('_over_', ' / ')} = {sig3(v)}×"
    return ""


def _provider_bytes(b: dict[str, Any], providers: list[str]) -> dict[str, tuple[str, float]]:
    """{provider: (field, bytes)}: ``bytes_per_rank`` entries, or bytes fields ending in a name."""
    e = _extra(b)
    held = e.get("bytes_per_rank")
    if isinstance(held, dict):
        nums = {str(k): _num(v) for k, v in held.items()}
        return {k: ("per rank", v) for k, v in nums.items() if v is not None}
    return {
        p: (k, v)
        for p in providers
        for k, raw in e.items()
        if "bytes" in k and k.endswith("_" + p) and (v := _num(raw)) is not None
    }


_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4}


def _theory_bytes(b: dict[str, Any]) -> tuple[str, float] | None:
    """(formula, bytes) of a ``<k>_psi_bytes`` field: k(N−1)/N·Ψ fp32 values."""
    for k, v in _extra(b).items():
        m = re.fullmatch(r"([a-z]+)_psi_bytes", k)
        if m and _num(v) is not None:
            n = _WORDS.get(m.group(1), m.group(1))
            return f"{n}(N−1)/N·Ψ·4 B", float(v)
    return None


# --------------------------------------------------------------------------------------------
# Panels


def _panel(
    title: str, quantity: str, unit: str, rows: list[tuple[str, str, float | None]], **kw: Any
) -> Panel:
    """Bars from (series, category, value) rows: categories and series in first-seen order."""
    cats = list(dict.fromkeys(c for _, c, _ in rows))
    names = _ordered(s for s, _, _ in rows)
    cell = {(s, c): v for s, c, v in rows}
    series = [Series(s, [cell.get((s, c)) for c in cats], i) for i, s in enumerate(names)]
    return Panel(title, quantity, unit, cats, series, **kw)


def _sent_panel(items: list[dict[str, Any]], cats: list[str]) -> Panel | None:
    """Bytes sent per rank per step, measured beside k(N−1)/N·Ψ, when both are recorded."""
    rows: list[tuple[str, str, float | None]] = []
    for b, c in zip(items, cats, strict=True):
        sent, theory = _num(_extra(b).get("sent_bytes")), _theory_bytes(b)
        if sent is None or theory is None:
            continue
        cat = f"{c}\ntheory {theory[0]}".strip()
        rows += [("fastpar (measured)", cat, sent), ("theory", cat, theory[1])]
    if not rows:
        return None
    p = _panel("bytes sent per rank per step: measured vs theory", "bytes sent", "B", rows)
    p.series[-1].colour = -1  # theory in grey
    return p


def _side_by_side(items: list[dict[str, Any]]) -> tuple[str, list[Panel]]:
    cats = _labels(items, whole=True)
    times = [_times(b) for b in items]
    provs = _ordered(p for t in times for p in t)
    rows: list[tuple[str, str, float | None]] = []
    for b, c, t in zip(items, cats, times, strict=True):
        cat = f"{c}\n{_time_ratio(b)}".strip()
        rows += [(p, cat, t.get(p)) for p in provs]
    panels = [
        _panel("time per step, measured side by side in the same ranks", "time per step", "s", rows)
    ]
    held = [_provider_bytes(b, provs) for b in items]
    if any(held):
        fields = ", ".join(dict.fromkeys(f for h in held for f, _ in h.values()))
        rows = [(p, c, h[p][1]) for h, c in zip(held, cats, strict=True) for p in provs if p in h]
        title = "bytes per rank" if fields == "per rank" else f"bytes ({fields})"
        panels.append(_panel(title, "bytes", "B", rows))
    fractions = list(
        dict.fromkeys(
            k
            for b in items
            for k, v in _extra(b).items()
            if "fraction" in k and _num(v) is not None
        )
    )
    if fractions:
        rows = [
            (k, c, _num(_extra(b).get(k)))
            for b, c in zip(items, cats, strict=True)
            for k in fractions
        ]
        panels.append(_panel("fractions", "fraction", "fraction", rows))
    sent = _sent_panel(items, cats)
    if sent is not None:
        panels.append(sent)
    what = (" vs " if len(provs) <= 3 else ", ").join(provs)
    return what, panels


def _bubble(by_group: dict[str, list[dict[str, Any]]]) -> list[Panel]:
    """Per group: measured idle fraction (solid) and theory (dashed) over m, a colour per bench."""
    panels = []
    for group, items in by_group.items():
        tables = [_extra(b).get("bubble") or {} for b in items]
        ms = list(dict.fromkeys(str(m) for t in tables for m in t))
        numeric = all(re.fullmatch(r"\d+(\.\d*)?", m) and float(m) > 0 for m in ms)
        ms = sorted(ms, key=float) if numeric else ms
        series = []
        for i, (label, t) in enumerate(zip(_labels(items, whole=True), tables, strict=True)):
            label = label.replace("\n", ", ")
            for key, dashed in (("measured", False), ("theory", True)):
                vals = [_num((t.get(m) or {}).get(key)) for m in ms]
                series.append(Series(f"{label} {key}".strip(), vals, i, dashed))
        x = [float(m) if numeric else float(i) for i, m in enumerate(ms)]
        panels.append(
            Panel(
                group,
                "idle fraction (bubble)",
                "fraction",
                ms,
                series,
                x=x,
                xlabel="micro-batches m",
            )
        )
    return panels


def _per_rank(items: list[dict[str, Any]], keys: list[str]) -> list[Panel]:
    labels = [c.replace("\n", ", ") for c in _labels(items, whole=True)]
    panels = []
    for key in keys:
        rows = [
            (label, f"rank {r}", _num(v))
            for b, label in zip(items, labels, strict=True)
            for r, v in enumerate(_extra(b).get(key) or [])
        ]
        unit = "B" if "bytes" in key else ""
        panels.append(_panel(key, key.replace("_", " "), unit, rows))
    return panels


def _planned(items: list[dict[str, Any]]) -> list[Panel]:
    cats = _labels(items, whole=True)
    rows: list[tuple[str, str, float | None]] = []
    for b, c in zip(items, cats, strict=True):
        held = _extra(b).get("held")
        held_total = _num(held.get("total")) if isinstance(held, dict) else None
        rows += [
            ("measured (held)", c, held_total),
            ("planned", c, _num(_extra(b)["planned_total"])),
        ]
    p = _panel("bytes held per rank: measured vs the planner", "bytes per rank", "B", rows)
    p.series[-1].colour = -1
    sent = _sent_panel(items, cats)
    return [p] if sent is None else [p, sent]


def _kernels(by_group: dict[str, list[dict[str, Any]]], fam: str) -> tuple[str, list[Panel]]:
    panels, provs = [], []
    for group, items in by_group.items():
        cats = _labels(items, skip=("provider",))
        rows = []
        for b, c in zip(items, cats, strict=True):
            prov = str(_params(b).get("provider", _extra(b).get("provider", "?")))
            rows.append((prov, c, _num((b.get("stats") or {}).get("median"))))
            provs.append(prov)
        title = group[len(fam) + 1 :] or group
        panels.append(_panel(title, "time per call (median)", "s", rows))
    return " vs ".join(_ordered(provs)), panels


def _scalar_keys(items: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(field, quantity, unit) of the single figures recorded: ``*_seconds``, ``*_per_second``."""
    out = {}
    for b in items:
        for k, v in _extra(b).items():
            if _num(v) is None or k in out:
                continue
            what = k.rsplit("_", 2)[0].replace("_", " ")
            if k.endswith("_per_second"):
                out[k] = (k, f"{what} per second", f"{what}/s")
            elif k.endswith("_seconds"):
                out[k] = (k, f"{k[: -len('_seconds')].replace('_', ' ')} time", "s")
    return list(out.values())


def _by_group(
    by_group: dict[str, list[dict[str, Any]]],
    fam: str,
    value: Callable[[dict[str, Any]], float | None],
) -> list[tuple[str, str, float | None]]:
    """Rows for a bar per benchmark: a series per group (its variant), the categories labelled
    by what differs between the benchmarks less the params that name the group (constant in
    each group: the world size of ``harness-2-ranks``)."""
    items = [b for bs in by_group.values() for b in bs]
    keys = dict.fromkeys(k for b in items for k in _params(b))

    def constant(bs: list[dict[str, Any]], k: str) -> bool:
        return len({repr(_params(b).get(k)) for b in bs}) == 1

    same: tuple[str, ...] = ()
    if len(by_group) > 1:
        same = tuple(k for k in keys if all(constant(bs, k) for bs in by_group.values()))
    labels = iter(_labels(items, skip=same))
    rows = []
    for group, bs in by_group.items():
        variant = group[len(fam) + 1 :] if len(by_group) > 1 else ""
        rows += [(variant or "fastpar", next(labels) or "—", value(b)) for b in bs]
    return rows


def _field(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda b: _num(_extra(b).get(key))


def _plot(fam: str, by_group: dict[str, list[dict[str, Any]]]) -> tuple[str, list[Panel], bool]:
    """(title, panels, grid) of one family's chart, by what its benchmarks record."""
    items = [b for bs in by_group.values() for b in bs]
    extras = [_extra(b) for b in items]
    if any(isinstance(e.get("bubble"), dict) for e in extras):
        return "idle fraction, measured vs theory", _bubble(by_group), True
    per_rank = list(
        dict.fromkeys(
            k
            for e in extras
            for k, v in e.items()
            if k.endswith("per_rank")
            and isinstance(v, list)
            and all(_num(x) is not None for x in v)
        )
    )
    if per_rank:
        return ", ".join(k.replace("_", " ") for k in per_rank), _per_rank(items, per_rank), False
    if all("planned_total" in e for e in extras):
        return "measured vs planned", _planned(items), False
    if any(_times(b) for b in items):
        what, panels = _side_by_side(items)
        return what, panels, False
    if any("provider" in _params(b) for b in items):
        what, panels = _kernels(by_group, fam)
        return f"{what}, time per call", panels, True
    figures = _scalar_keys(items)
    if figures:
        panels = [_panel(k, q, u, _by_group(by_group, fam, _field(k))) for k, q, u in figures]
        return ", ".join(q for _, q, _ in figures), panels, False
    rows = _by_group(by_group, fam, lambda b: _num((b.get("stats") or {}).get("median")))
    title = "time per round (pytest-benchmark median: everything one round runs)"
    return "time per round", [_panel(title, "time per round", "s", rows)], False


def _recolour(panels: list[Panel]) -> None:
    """One colour per series label across a chart's bar panels (theory stays grey)."""
    index: dict[str, int] = {}
    for p in panels:
        for s in p.series if p.x is None else []:
            if s.colour >= 0:
                s.colour = index.setdefault(s.label, len(index))


def build_charts(runs: list[Any], note: Callable[[Any], str] = lambda run: "") -> list[Chart]:
    """One chart per family per input file (``run.label``, ``run.benchmarks``), named after the
    family, plus ``-<label>`` when several inputs hold that family; ``note(run)`` is its footer."""
    per_run: list[tuple[Any, dict[str, dict[str, list[dict[str, Any]]]]]] = []
    for run in runs:
        fams: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for b in run.benchmarks:
            group = str(b.get("group") or "(no group)")
            fams.setdefault(family(group), {}).setdefault(group, []).append(b)
        per_run.append((run, fams))
    holders: dict[str, int] = {}
    for _, fams in per_run:
        for fam in fams:
            holders[fam] = holders.get(fam, 0) + 1
    charts, used = [], set()
    for run, fams in per_run:
        for fam, by_group in fams.items():
            what, panels, grid = _plot(fam, by_group)
            _recolour(panels)
            name = chart_filename(fam if holders[fam] == 1 else f"{fam}-{run.label}")
            stem, n = name[:-4], 2
            while name in used:
                name, n = f"{stem}-{n}.png", n + 1
            used.add(name)
            charts.append(Chart(name, f"{fam}: {what}", note(run), list(by_group), panels, grid))
    return charts
