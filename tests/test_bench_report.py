"""bench/report.py: markdown tables, hand-written PNG charts, exit code 2 on bad input."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "report.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


report = _load()


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


def _read_png(path: Path) -> tuple[int, int, bytes]:
    """(width, height, raw scanlines) of an 8-bit RGB PNG, checking its structure."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, ihdr, kinds = 8, b"", None, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, payload = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF
        kinds.append(kind)
        if kind == b"IHDR":
            ihdr = payload
        elif kind == b"IDAT":
            idat += payload
        pos += 12 + n
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and ihdr is not None
    width, height, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", ihdr)
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(idat)
    assert len(raw) == height * (1 + 3 * width)
    assert all(raw[y * (1 + 3 * width)] == 0 for y in range(height))  # filter type 0
    return width, height, raw


def _bar_lengths(path: Path) -> list[int]:
    """Bar-coloured pixels per row, one number per run of rows that contain a bar."""
    width, height, raw = _read_png(path)
    colours = {bytes(c) for c in report.BAR_COLOURS}
    counts = []
    for y in range(height):
        row = raw[y * (1 + 3 * width) + 1 : (y + 1) * (1 + 3 * width)]
        counts.append(sum(row[3 * x : 3 * x + 3] in colours for x in range(width)))
    bars, prev = [], 0
    for c in counts:
        if c and not prev:
            bars.append(c)
        prev = c
    return bars


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


def test_pngs_are_valid_and_bars_follow_the_medians(rendered: Path) -> None:
    pngs = sorted(p.name for p in rendered.glob("*.png"))
    assert pngs == ["pipe_bubble.png", "tp-mlp.png"]
    for name in pngs:
        width, height, _ = _read_png(rendered / name)
        assert width == 800 and 100 < height < 1000
    short, long = _bar_lengths(rendered / "tp-mlp.png")  # medians 1 ms and 4 ms
    assert long > short > 0 and long / short == pytest.approx(4, rel=0.05)
    first, second = _bar_lengths(rendered / "pipe_bubble.png")  # 2 µs and 0.5 µs
    assert first > second > 0 and first / second == pytest.approx(4, rel=0.05)


def test_two_inputs_get_a_file_column(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_results()))
    b.write_text(json.dumps(_results()))
    assert report.main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| file | name | params | median |" in md and "| b | test_mlp[512] |" in md
    assert len(_bar_lengths(tmp_path / "out" / "tp-mlp.png")) == 4


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


def test_encoder_round_trip(tmp_path: Path) -> None:
    cv = report.Canvas(7, 3)
    cv.rect(1, 1, 4, 2, (255, 0, 0))
    path = tmp_path / "t.png"
    path.write_bytes(cv.png())
    width, height, raw = _read_png(path)
    assert (width, height) == (7, 3)
    row1 = raw[1 * 22 + 1 : 2 * 22]
    assert row1[3:6] == b"\xff\x00\x00" and row1[12:15] == b"\xff\xff\xff"


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
