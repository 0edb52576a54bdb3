"""Render pytest-benchmark JSON files as a markdown report and one chart per comparison.

    pytest bench/ --benchmark-json=bench/results/run.json
    python bench/report.py bench/results/run.json [MORE.json ...] [--out DIR] [--no-charts]

Draws on demand what a run recorded, into DIR: ``bench/results/report`` unless given (git
ignores ``bench/results/``: runs and reports stay out of the source). Writes ``DIR/report.md``
(a header per input file, then one table per benchmark group: name, params, median, rounds and
the numeric ``extra_info`` fields, ratios as readable columns) and ``DIR/<family>.png``: one
matplotlib chart per comparison and input file, plotting the numbers the benchmarks record side
by side (``report_charts.py`` says which, ``report_plot.py`` draws them). The charts need
matplotlib (``pip install fastpar[bench]``); ``--no-charts`` writes only report.md. Exits 2
when an input file is missing or is not a pytest-benchmark JSON file, or when matplotlib is
missing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from report_charts import BYTE_UNITS, TIME_UNITS, build_charts, family, sig3
from report_plot import save

#: where the report goes without ``--out``: inside the git-ignored ``bench/results/``
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "report"

# --------------------------------------------------------------------------------------------
# Reading the inputs


class ReportError(Exception):
    """An input file that cannot be used (missing, unreadable, not pytest-benchmark JSON)."""


@dataclass
class Run:
    """One input file: its label (file stem), machine information and benchmarks."""

    path: Path
    label: str
    data: dict[str, Any]
    benchmarks: list[dict[str, Any]] = field(default_factory=list)


def load_run(path: Path) -> Run:
    """Read and check one pytest-benchmark JSON file; raise ReportError when unusable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except OSError as e:
        raise ReportError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ReportError(
            f"{path}: not a pytest-benchmark JSON file (no top-level 'benchmarks' list); "
            "write one with: pytest bench/ --benchmark-json=FILE"
        )
    for i, b in enumerate(data["benchmarks"]):
        if not isinstance(b, dict) or not isinstance(b.get("stats"), dict):
            raise ReportError(f"{path}: benchmark #{i} has no 'stats' object")
    return Run(path, path.stem, data, data["benchmarks"])


# --------------------------------------------------------------------------------------------
# Formatting numbers


def fmt_time(seconds: float | None) -> str:
    """Seconds with an automatic unit: ns, µs, ms or s (three significant digits)."""
    if seconds is None or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "—"
    unit, scale = next(((u, s) for u, s in TIME_UNITS if abs(seconds) >= s), TIME_UNITS[-1])
    return f"{sig3(seconds / scale)} {unit}"


def _fmt_bytes(n: float) -> str:
    unit, scale = next(((u, s) for u, s in BYTE_UNITS if abs(n) >= s), BYTE_UNITS[-1])
    return f"{n:.0f} B" if unit == "B" else f"{sig3(n / scale)} {unit}"


def _fmt_rate(n: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(n) >= scale:
            return f"{sig3(n / scale)} {unit}"
    return f"{sig3(n)} B/s"


def _kind(key: str) -> str:
    """How a flattened extra_info key is shown: ratio, fraction, time, rate, bytes or number."""
    k = key.lower()
    last = k.rsplit(".", 1)[-1]
    if "_over_" in last or "_vs_" in last or last.startswith("ratio") or last.endswith("_ratio"):
        return "ratio"
    if "fraction" in last:
        return "fraction"
    if "per_s" in k:
        return "rate"
    if "bytes" in k:
        return "bytes"
    if last.endswith("_ms"):
        return "ms"
    if "seconds" in k or last.endswith("_s") or last in ("s", "time", "step_time"):
        return "time"
    return "number"


def fmt_value(key: str, v: Any) -> str:
    """One extra_info value as a table cell, formatted by what its key says it is."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return ", ".join(fmt_value(key, x) for x in v)
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return str(v)
    kind = _kind(key)
    if kind == "ratio":
        return f"{sig3(v)}×"
    if kind == "fraction":
        return f"{v * 100:.1f} %"
    if kind == "time":
        return fmt_time(v)
    if kind == "ms":
        return fmt_time(v * 1e-3)
    if kind == "bytes":
        return _fmt_bytes(v)
    if kind == "rate":
        return _fmt_rate(v)
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 100_000 else str(v)
    return f"{v:.4g}"


def header_for(key: str) -> str:
    """A readable column header: ``a_over_b`` becomes ``a / b``."""
    parts = key.split(".")
    parts[-1] = parts[-1].replace("_over_", " / ").replace("_vs_", " vs ")
    return ".".join(parts)


# --------------------------------------------------------------------------------------------
# Flattening extra_info into columns and sub-tables

MAX_LIST = 8  # lists of numbers up to this length are shown in one cell
MAX_STR = 24  # strings up to this length are shown


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_cell(v: Any) -> bool:
    if v is None or _is_number(v) or isinstance(v, bool):
        return True
    if isinstance(v, str):
        return len(v) <= MAX_STR
    if isinstance(v, list):
        return 0 < len(v) <= MAX_LIST and all(_is_number(x) for x in v)
    return False


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts become ``key.sub`` entries; leaves that fit in a cell are kept."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif _is_cell(value):
        out[prefix] = value
    return out


def _is_table(v: Any) -> bool:
    """A dict whose values are all dicts (e.g. the pipeline ``bubble`` table): a sub-table."""
    return isinstance(v, dict) and bool(v) and all(isinstance(x, dict) for x in v.values())


def split_extra(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(flat columns, sub-tables) of one benchmark's extra_info."""
    cols: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for k, v in (extra or {}).items():
        if _is_table(v):
            tables[str(k)] = v
        else:
            cols.update(flatten(v, str(k)))
    return cols, tables


def _column_order(keys: list[str]) -> list[str]:
    """Ratios and fractions first (what to compare), then the rest in first-seen order."""
    rank = {"ratio": 0, "fraction": 1}
    return sorted(keys, key=lambda k: (rank.get(_kind(k), 2), keys.index(k)))


# --------------------------------------------------------------------------------------------
# Markdown


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return lines


def _fmt_date(s: Any) -> str:
    if not isinstance(s, str):
        return "unknown"
    try:
        return datetime.fromisoformat(s).strftime("%Y-%m-%d %H:%M %Z").strip()
    except ValueError:
        return s


def run_header(run: Run) -> dict[str, str]:
    """device / torch / fastpar / commit / date / cpu of one input file."""
    mi = run.data.get("machine_info") or {}
    ci = run.data.get("commit_info") or {}
    commit = mi.get("commit") or str(ci.get("id") or "unknown")[:9]
    if ci.get("dirty"):
        commit += " (dirty)"
    cpu = (mi.get("cpu") or {}) if isinstance(mi.get("cpu"), dict) else {}
    cpu_s = cpu.get("brand_raw") or mi.get("processor") or mi.get("machine") or "?"
    if cpu.get("count"):
        cpu_s += f", {cpu['count']} cores"
    return {
        "device": str(mi.get("device", "unknown")),
        "torch": str(mi.get("torch", "unknown")),
        "fastpar": str(mi.get("fastpar", "unknown")),
        "commit": commit,
        "date": _fmt_date(run.data.get("datetime")),
        "cpu": cpu_s,
    }


def _params(b: dict[str, Any]) -> str:
    p = b.get("params") or {}
    return ", ".join(f"{k}={v}" for k, v in p.items()) if isinstance(p, dict) else str(p)


HOW_TO_READ = """\
**How to read.** The median is the time of one benchmark round (for the multi-rank benchmarks
one round includes starting the ranks). On a CPU, absolute times are noise: a shared machine,
ranks as processes over gloo. Compare *ratios measured side by side* in the same round: an
`a / b` column is `a`'s time (or bytes) divided by `b`'s, so `dtensor / fastpar` above 1×
means fastpar took less. Compare medians only within one group of one file. Fractions are in
percent; `—` is a value that this machine does not measure (e.g. GPU memory on a CPU).

**Charts.** One per comparison and input file. They plot what the benchmarks record side by
side in `extra_info` — each provider's time per step (the ratio under each pair), bytes per
rank, fractions, bubbles measured against theory — not the round median; only the kernels
(one call a round) and the harness (whose round is the start-up it measures) show medians."""


def groups_of(runs: list[Run]) -> dict[str, list[tuple[Run, dict[str, Any]]]]:
    """Benchmarks by group, a family's groups together, in order of first appearance."""
    groups: dict[str, list[tuple[Run, dict[str, Any]]]] = {}
    for run in runs:
        for b in run.benchmarks:
            groups.setdefault(str(b.get("group") or "(no group)"), []).append((run, b))
    order = list(dict.fromkeys(family(g) for g in groups))
    return dict(sorted(groups.items(), key=lambda kv: order.index(family(kv[0]))))


def render_markdown(runs: list[Run], charts: dict[str, list[tuple[str, str]]]) -> str:
    """The whole report.md text; ``charts`` maps a group to the (title, PNG file) to show
    after its table."""
    lines = ["# Benchmark report", ""]
    info = [(r, run_header(r)) for r in runs]
    keys = ["device", "torch", "fastpar", "commit", "date", "cpu"]
    lines += _md_table(["file", *keys], [[r.path.name] + [h[k] for k in keys] for r, h in info])
    lines += ["", HOW_TO_READ, ""]
    multi = len(runs) > 1
    for group, items in groups_of(runs).items():
        lines += [f"## {group}", ""]
        flat = [split_extra(b.get("extra_info") or {}) for _, b in items]
        seen: list[str] = []
        for cols, _ in flat:
            seen += [k for k, v in cols.items() if k not in seen and v is not None]
        extra_keys = _column_order(seen)
        header = (["file"] if multi else []) + ["name", "params", "median", "rounds"]
        header += [header_for(k) for k in extra_keys]
        rows = []
        for (run, b), (cols, _) in zip(items, flat, strict=True):
            st = b.get("stats") or {}
            row = ([run.label] if multi else []) + [
                str(b.get("name", "?")),
                _params(b) or "—",
                fmt_time(st.get("median")),
                str(st.get("rounds", "—")),
            ]
            row += [fmt_value(k, cols[k]) if k in cols else "—" for k in extra_keys]
            rows.append(row)
        lines += _md_table(header, rows)
        lines.append("")
        lines += _sub_tables(items, flat, multi, group)
        for title, name in charts.get(group, []):
            lines += [f"![{title}]({name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _sub_tables(
    items: list[tuple[Run, dict[str, Any]]],
    flat: list[tuple[dict[str, Any], dict[str, dict[str, Any]]]],
    multi: bool,
    group: str,
) -> list[str]:
    """One table per dict-of-dicts extra_info entry: a row per (benchmark, entry key)."""
    names: list[str] = []
    for _, tables in flat:
        names += [n for n in tables if n not in names]
    lines: list[str] = []
    for name in names:
        rows_src = []
        inner: list[str] = []
        for (run, b), (_, tables) in zip(items, flat, strict=True):
            for key, sub in (tables.get(name) or {}).items():
                cols = flatten(sub)
                inner += [k for k in cols if k not in inner]
                rows_src.append((run, b, key, cols))
        inner = _column_order(inner)
        header = (["file"] if multi else []) + ["name", "params", name]
        header += [header_for(k) for k in inner]
        rows = [
            ([run.label] if multi else [])
            + [str(b.get("name", "?")), _params(b) or "—", str(key)]
            + [fmt_value(k, cols[k]) if k in cols else "—" for k in inner]
            for run, b, key, cols in rows_src
        ]
        lines += [f"**{group}: `{name}`**", "", *_md_table(header, rows), ""]
    return lines


# --------------------------------------------------------------------------------------------
# Command line


def _note(run: Run) -> str:
    h = run_header(run)
    return f"{run.path.name} · device {h['device']} · torch {h['torch']} · commit {h['commit']}"


def _missing_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 bad input or no matplotlib)."""
    ap = argparse.ArgumentParser(
        prog="bench/report.py",
        description="Render pytest-benchmark JSON files as report.md and one PNG per comparison.",
    )
    ap.add_argument("results", nargs="+", type=Path, help="pytest-benchmark JSON files")
    ap.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="output folder, created (default: %(default)s)",
    )
    ap.add_argument("--no-charts", action="store_true", help="write report.md only (no matplotlib)")
    args = ap.parse_args(argv)
    try:
        runs = [load_run(p) for p in args.results]
    except ReportError as e:
        print(f"bench/report.py: error: {e}", file=sys.stderr)
        return 2
    if not args.no_charts and _missing_matplotlib():
        print(
            "bench/report.py: error: the charts need matplotlib: pip install fastpar[bench] "
            "(in a checkout: pip install -e '.[bench]'), or pass --no-charts",
            file=sys.stderr,
        )
        return 2
    seen: dict[str, int] = {}
    for r in runs:  # distinct labels when two inputs share a file stem
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label}#{seen[r.label]}"
    args.out.mkdir(parents=True, exist_ok=True)
    charts = [] if args.no_charts else build_charts(runs, _note)
    order = list(groups_of(runs))
    placed: dict[str, list[tuple[str, str]]] = {}
    for chart in charts:  # after the last of its groups' tables
        save(chart, args.out / chart.name)
        last = max(chart.groups, key=order.index)
        placed.setdefault(last, []).append((chart.title, chart.name))
    (args.out / "report.md").write_text(render_markdown(runs, placed))
    n = sum(len(r.benchmarks) for r in runs)
    print(f"wrote {args.out / 'report.md'} and {len(charts)} charts ({n} benchmarks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
