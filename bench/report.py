"""Render pytest-benchmark JSON files as a markdown report and one bar chart per group.

    python bench/report.py RESULTS.json [MORE.json ...] --out DIR

Writes ``DIR/report.md`` (a header per input file, then one table per benchmark group: name,
params, median, rounds and the numeric ``extra_info`` fields, ratios as readable columns) and
``DIR/<group>.png`` (horizontal bars, median time per benchmark). No plotting library: the PNG
encoder (``zlib`` + ``struct``) and the 5x7 bitmap font are in this file. Exits 2 when an input
file is missing or is not a pytest-benchmark JSON file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

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


def _sig3(x: float) -> str:
    """Three significant digits, trailing zeros kept (1.00, 12.3, 123, 1234)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def fmt_time(seconds: float | None) -> str:
    """Seconds with an automatic unit: ns, µs, ms or s (three significant digits)."""
    if seconds is None or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{_sig3(seconds / scale)} {unit}"
    return f"{_sig3(seconds / 1e-9)} ns"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{_sig3(n / scale)} {unit}"
    return f"{n:.0f} B"


def _fmt_rate(n: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(n) >= scale:
            return f"{_sig3(n / scale)} {unit}"
    return f"{_sig3(n)} B/s"


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
        return f"{_sig3(v)}×"
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
percent; `—` is a value that this machine does not measure (e.g. GPU memory on a CPU)."""


def groups_of(runs: list[Run]) -> dict[str, list[tuple[Run, dict[str, Any]]]]:
    """Benchmarks by group, in order of first appearance across the inputs."""
    groups: dict[str, list[tuple[Run, dict[str, Any]]]] = {}
    for run in runs:
        for b in run.benchmarks:
            groups.setdefault(str(b.get("group") or "(no group)"), []).append((run, b))
    return groups


def render_markdown(runs: list[Run], charts: dict[str, str]) -> str:
    """The whole report.md text; ``charts`` maps a group to its PNG file name."""
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
        if group in charts:
            lines += [f"![{group}]({charts[group]})", ""]
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
# PNG: encoder, 5x7 bitmap font, canvas

RGB = tuple[int, int, int]


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG; ``rgb`` holds ``height`` rows of ``3 * width`` bytes (filter 0)."""
    if len(rgb) != 3 * width * height:
        raise ValueError("pixel buffer does not match width * height * 3")
    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


# Each glyph: 7 rows of 5 bits, most significant bit on the left, as 14 hex digits.
_FONT_HEX = {
    "A": "0E11111F111111", "B": "1E11111E11111E", "C": "0E11101010110E", "D": "1C12111111121C",
    "E": "1F10101E10101F", "F": "1F10101E101010", "G": "0E11101711110F", "H": "1111111F111111",
    "I": "0E04040404040E", "J": "0702020202120C", "K": "11121418141211", "L": "1010101010101F",
    "M": "111B1515111111", "N": "11111915131111", "O": "0E11111111110E", "P": "1E11111E101010",
    "Q": "0E11111115120D", "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404",
    "U": "1111111111110E", "V": "11111111110A04", "W": "1111111515150A", "X": "11110A040A1111",
    "Y": "1111110A040404", "Z": "1F01020408101F",
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F", "3": "1F02040201110E",
    "4": "02060A121F0202", "5": "1F101E0101110E", "6": "0608101E11110E", "7": "1F010204080808",
    "8": "0E11110E11110E", "9": "0E11110F01020C",
    " ": "00000000000000", "_": "0000000000001F", "-": "0000001F000000", ".": "00000000000C0C",
    ",": "000000000C0408", ":": "000C0C000C0C00", ";": "000C0C000C0408", "[": "0E08080808080E",
    "]": "0E02020202020E", "(": "02040808080402", ")": "08040202020408", "=": "00001F001F0000",
    "/": "00010204081000", "%": "18190204081303", "+": "0004041F040400", "*": "0004150E150400",
    "µ": "00001111131D10", "×": "00110A040A1100", "?": "0E110102040004", "!": "04040404040004",
    "<": "02040810080402", ">": "08040201020408", "'": "04040800000000", '"': "0A0A0000000000",
    "#": "0A0A1F0A1F0A0A", "|": "04040404040404", "@": "0E11171515100F", "&": "0C12140815120D",
    "a": "00000E010F110F", "b": "1010161911111E", "c": "00000E1010110E",
    "d": "01010D1311110F", "e": "00000E111F100E", "f": "0609081C080808", "g": "000F11110F010E",
    "h": "10101619111111", "i": "04000C0404040E", "j": "0200060202120C", "k": "10101214181412",
    "l": "0C04040404040E", "m": "00001A15151111", "n": "00001619111111", "o": "00000E1111110E",
    "p": "00001E11111E10", "q": "00000F11110F01", "r": "00001619101010", "s": "00000E100E011E",
    "t": "08081C08080906", "u": "0000111111130D", "v": "00001111110A04", "w": "0000111115150A",
    "x": "0000110A040A11", "y": "000011110F010E", "z": "00001F0204081F",
}  # fmt: skip
FONT: dict[str, list[int]] = {
    c: [int(h[i : i + 2], 16) for i in range(0, 14, 2)] for c, h in _FONT_HEX.items()
}
GLYPH_W, GLYPH_H = 5, 7

BACKGROUND: RGB = (255, 255, 255)
TEXT: RGB = (30, 30, 30)
MUTED: RGB = (110, 110, 110)
GRID: RGB = (225, 225, 225)
AXIS: RGB = (150, 150, 150)
# One bar colour per input file (cycled); no text or grid line uses these colours.
BAR_COLOURS: list[RGB] = [(70, 130, 180), (230, 126, 34), (46, 160, 67), (155, 89, 182)]


class Canvas:
    """An RGB pixel buffer with filled rectangles and 5x7 bitmap text."""

    def __init__(self, width: int, height: int, bg: RGB = BACKGROUND) -> None:
        self.width, self.height = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, colour: RGB) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x0 >= x1:
            return
        line = bytes(colour) * (x1 - x0)
        for y in range(y0, y1):
            start = 3 * (y * self.width + x0)
            self.px[start : start + len(line)] = line

    @staticmethod
    def text_width(s: str, scale: int = 1) -> int:
        """Width in pixels of ``s`` drawn at ``scale`` (one blank column between glyphs)."""
        return max(0, len(s) * (GLYPH_W + 1) * scale - scale)

    def text(self, x: int, y: int, s: str, colour: RGB = TEXT, scale: int = 1) -> None:
        """Draw ``s`` with its top-left corner at (x, y); unknown characters as ``?``."""
        for ch in s:
            rows = FONT.get(ch) or FONT.get(ch.upper()) or FONT["?"]
            for r, bits in enumerate(rows):
                for c in range(GLYPH_W):
                    if bits & (1 << (GLYPH_W - 1 - c)):
                        px, py = x + c * scale, y + r * scale
                        self.rect(px, py, px + scale, py + scale, colour)
            x += (GLYPH_W + 1) * scale

    def png(self) -> bytes:
        """The canvas as PNG bytes."""
        return encode_png(self.width, self.height, self.px)


def _fit(s: str, max_px: int, scale: int) -> str:
    """``s`` cut (with ``..``) to fit in ``max_px`` pixels."""
    n = max_px // ((GLYPH_W + 1) * scale)
    return s if len(s) <= n else s[: max(0, n - 2)] + ".."


def _trim(s: str) -> str:
    """``1.00 s`` -> ``1 s``, ``2.50 ms`` -> ``2.5 ms`` (tick labels)."""
    num, _, unit = s.partition(" ")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return f"{num} {unit}".strip()


def _nice_step(span: float, target: int = 5) -> float:
    """A 1/2/5 x 10^k tick step giving about ``target`` ticks over ``span``."""
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


WIDTH = 800
MARGIN = 16
SCALE = 2  # labels, values and title: 5x7 glyphs drawn 2x
LABEL_H = GLYPH_H * SCALE
BAR_H = 18
ROW_H = LABEL_H + 4 + BAR_H + 12


def bar_chart(
    title: str, bars: list[tuple[str, float | None, int]], footer: str = "", width: int = WIDTH
) -> Canvas:
    """Horizontal bars: (label, median seconds, colour index) each, on a shared linear axis."""
    top = MARGIN + LABEL_H + 8 + GLYPH_H + 14
    axis_y = top + len(bars) * ROW_H
    height = axis_y + 6 + LABEL_H + 10 + (GLYPH_H + 10 if footer else 0) + MARGIN
    cv = Canvas(width, height)
    cv.text(MARGIN, MARGIN, _fit(title, width - 2 * MARGIN, SCALE), TEXT, SCALE)
    cv.text(MARGIN, MARGIN + LABEL_H + 8, "median time per benchmark (shorter is faster)", MUTED, 1)
    value_w = Canvas.text_width("999 ms", SCALE) + 10
    x0, x1 = MARGIN, width - MARGIN - value_w
    vmax = max((v for _, v, _ in bars if v is not None and v > 0), default=0.0)
    if vmax > 0:  # grid lines and tick labels
        step = _nice_step(vmax)
        vmax = max(vmax, step)
        ticks = [i * step for i in range(int(vmax / step + 1e-9) + 1)]
        for t in ticks:
            gx = x0 + round(t / vmax * (x1 - x0))
            cv.rect(gx, top - 6, gx + 1, axis_y, GRID if t else AXIS)
            label = "0" if t == 0 else _trim(fmt_time(t))
            tw = Canvas.text_width(label, SCALE)
            lx = min(max(gx - tw // 2, 0), width - tw - 2)
            cv.text(lx, axis_y + 6, label, MUTED, SCALE)
    cv.rect(x0, axis_y, x1, axis_y + 1, AXIS)
    for i, (label, v, colour) in enumerate(bars):
        y = top + i * ROW_H
        cv.text(x0 + 4, y, _fit(label, width - 2 * MARGIN - 4, SCALE), TEXT, SCALE)
        by = y + LABEL_H + 4
        length = 0
        if v is not None and v > 0 and vmax > 0:
            length = max(1, round(v / vmax * (x1 - x0)))
            cv.rect(x0, by, x0 + length, by + BAR_H, BAR_COLOURS[colour % len(BAR_COLOURS)])
        cv.text(x0 + length + 6, by + (BAR_H - LABEL_H) // 2, fmt_time(v), TEXT, SCALE)
    if footer:
        cv.text(MARGIN, axis_y + 6 + LABEL_H + 10, _fit(footer, width - 2 * MARGIN, 1), MUTED, 1)
    return cv


def chart_filename(group: str) -> str:
    """A safe file name for a group's chart."""
    return (re.sub(r"[^A-Za-z0-9_.-]+", "_", group).strip("._") or "group") + ".png"


def render_charts(runs: list[Run], out: Path) -> dict[str, str]:
    """Write one PNG per group into ``out``; return group -> file name."""
    multi = len(runs) > 1
    index = {id(r): i for i, r in enumerate(runs)}
    written: dict[str, str] = {}
    used: set[str] = set()
    for group, items in groups_of(runs).items():
        bars = [
            (
                (f"{run.label}: " if multi else "") + str(b.get("name", "?")),
                (b.get("stats") or {}).get("median"),
                index[id(run)],
            )
            for run, b in items
        ]
        devices = sorted({run_header(run)["device"] for run, _ in items})
        footer = "device: " + ", ".join(devices)
        if multi:
            footer += "   colours: " + ", ".join(
                f"{r.label}={['blue', 'orange', 'green', 'purple'][i % 4]}"
                for i, r in enumerate(runs)
            )
        name = chart_filename(group)
        stem, n = name[:-4], 2
        while name in used:
            name, n = f"{stem}-{n}.png", n + 1
        used.add(name)
        (out / name).write_bytes(bar_chart(group, bars, footer).png())
        written[group] = name
    return written


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 bad input)."""
    ap = argparse.ArgumentParser(
        prog="bench/report.py",
        description="Render pytest-benchmark JSON files as report.md and one PNG per group.",
    )
    ap.add_argument("results", nargs="+", type=Path, help="pytest-benchmark JSON files")
    ap.add_argument("--out", type=Path, required=True, help="output folder (created)")
    args = ap.parse_args(argv)
    try:
        runs = [load_run(p) for p in args.results]
    except ReportError as e:
        print(f"bench/report.py: error: {e}", file=sys.stderr)
        return 2
    seen: dict[str, int] = {}
    for r in runs:  # distinct labels when two inputs share a file stem
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label}#{seen[r.label]}"
    args.out.mkdir(parents=True, exist_ok=True)
    charts = render_charts(runs, args.out)
    (args.out / "report.md").write_text(render_markdown(runs, charts))
    n = sum(len(r.benchmarks) for r in runs)
    print(f"wrote {args.out / 'report.md'} and {len(charts)} charts ({n} benchmarks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
