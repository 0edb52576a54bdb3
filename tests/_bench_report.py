"""bench/report.py and its modules as the tests import them (``report``, ``charts``, ``plot``,
with bench/ on sys.path as ``python bench/report.py`` runs), and the records of a
pytest-benchmark JSON file: ``bench`` (one benchmark), ``results`` (a file of them)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "report.py"
sys.path.insert(0, str(ROOT / "bench"))  # as `python bench/report.py` runs it
report = importlib.import_module("report")
charts = importlib.import_module("report_charts")
plot = importlib.import_module("report_plot")
MiB = 2**20


def bench(group: str, name: str, params: dict, median: float, extra: dict) -> dict:
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


def results() -> dict:
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
            bench(
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
            bench(
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
            bench("pipe/bubble", "test_bubble[2]", {"p": 2}, 2e-6, {"bubble": bubble}),
            bench("pipe/bubble", "test_bubble[4]", {"p": 4}, 5e-7, {"bubble": bubble}),
        ],
    }
