"""The GPU check: the GPU test tier and every kernel benchmark, summarised in one folder.

    python bench/gpu_check.py OUTDIR

On a machine with an NVIDIA GPU: runs ``pytest -m cuda tests/`` and then
``pytest bench/ -k "not harness" --benchmark-json`` (every benchmark under bench/ except the
multi-rank harness ones, so a new kernel joins by adding a benchmark file), each phase under
its own time limit (about 8 minutes in all), and writes into OUTDIR: ``tests.log``,
``bench.log``, ``bench.json`` (pytest-benchmark's own), ``results.json`` (a summary) and
``results.md`` (one table row per benchmark: name, median, HBM bandwidth fraction if known).
Exits 1 when the GPU tests fail (or time out), 2 when there is no GPU, 0 otherwise; a failed
or timed-out benchmark run is reported in the files without failing the check.

``python bench/gpu_check.py --table BENCH_JSON OUTDIR`` writes only the two summaries from an
existing pytest-benchmark JSON file (works on any machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_LIMIT_S = 180
BENCH_LIMIT_S = 290


def _run(cmd: list[str], log: Path, limit: float) -> tuple[int | None, float]:
    """Run ``cmd`` in the repository root, output to ``log``; (exit code or None on timeout, s)."""
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            rc: int | None = subprocess.run(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=limit, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n*** timed out after {limit:.0f} s ***\n")
            rc = None
    return rc, time.monotonic() - start


def _fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3f} {unit}"
    return f"{seconds / 1e-9:.1f} ns"


def summarise(bench_json: dict) -> list[dict]:
    """One row per benchmark: name, group, median (s), hbm_fraction, bytes_per_s, extra_info."""
    rows = []
    for b in bench_json.get("benchmarks", []):
        extra = b.get("extra_info", {}) or {}
        rows.append(
            {
                "name": b.get("fullname") or b.get("name"),
                "group": b.get("group"),
                "median_s": (b.get("stats") or {}).get("median"),
                "hbm_fraction": extra.get("hbm_fraction"),
                "bytes_per_s": extra.get("bytes_per_s"),
                "extra_info": extra,
            }
        )
    return sorted(rows, key=lambda r: (str(r["group"]), str(r["name"])))


def markdown(rows: list[dict], machine: dict | None = None, header: str = "") -> str:
    """A markdown table of ``rows`` (from ``summarise``)."""
    lines = [header] if header else []
    if machine:
        keys = ("device", "torch", "fastpar", "commit")
        lines.append(", ".join(f"{k} {machine[k]}" for k in keys if k in machine) + "\n")
    lines += [
        "| benchmark | median | bandwidth (of peak HBM, else bytes/s) |",
        "| --- | ---: | ---: |",
    ]
    for r in rows:
        median = _fmt_time(r["median_s"]) if r["median_s"] is not None else "n/a"
        if r["hbm_fraction"] is not None:
            bw = f"{100 * r['hbm_fraction']:.1f} %"
        elif r["bytes_per_s"] is not None:
            bw = f"{r['bytes_per_s'] / 1e9:.1f} GB/s"
        else:
            bw = ""
        lines.append(f"| {r['name']} | {median} | {bw} |")
    return "\n".join(lines) + "\n"


def write_summaries(bench_json: dict | None, out: Path, status: dict) -> None:
    rows = summarise(bench_json or {})
    machine = (bench_json or {}).get("machine_info", {})
    (out / "results.json").write_text(
        json.dumps({"status": status, "machine": machine, "benchmarks": rows}, indent=2) + "\n"
    )
    head = "# GPU check\n\n" + "".join(f"- {k}: {v}\n" for k, v in status.items()) + "\n"
    (out / "results.md").write_text(markdown(rows, machine, head))


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--table":
        out = Path(argv[2])
        out.mkdir(parents=True, exist_ok=True)
        data = _load(Path(argv[1]))
        if data is None:
            print(f"cannot read a pytest-benchmark JSON file from {argv[1]}", file=sys.stderr)
            return 2
        write_summaries(data, out, {"source": argv[1]})
        print((out / "results.md").read_text())
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no NVIDIA GPU visible to torch (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}); nothing run. Use a GPU "
            "machine, or run the CPU and interpreter tiers with scripts/run_tests.sh.",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env_note = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    test_rc, test_s = _run(
        [py, "-m", "pytest", "-m", "cuda", "tests/", "-q", "-p", "no:cacheprovider"],
        out / "tests.log",
        TEST_LIMIT_S,
    )
    bench_json = out / "bench.json"
    bench_rc, bench_s = _run(
        [
            py,
            "-m",
            "pytest",
            "bench/",
            "-k",
            "not harness",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--benchmark-json={bench_json}",
        ],
        out / "bench.log",
        BENCH_LIMIT_S,
    )
    tests_ok = test_rc in (0, 5)  # 5: no test carries the cuda marker
    status = {
        "device": torch.cuda.get_device_name(0),
        "CUDA_VISIBLE_DEVICES": env_note,
        "gpu tests": "passed" if tests_ok else f"FAILED (exit {test_rc}, see tests.log)",
        "gpu tests seconds": round(test_s, 1),
        "benchmarks": "ok" if bench_rc == 0 else f"exit {bench_rc} (see bench.log)",
        "benchmark seconds": round(bench_s, 1),
    }
    if test_rc is None:
        status["gpu tests"] = f"TIMED OUT after {TEST_LIMIT_S} s (see tests.log)"
    if bench_rc is None:
        status["benchmarks"] = f"TIMED OUT after {BENCH_LIMIT_S} s: no JSON (see bench.log)"
    write_summaries(_load(bench_json), out, status)
    print((out / "results.md").read_text())
    return 0 if tests_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
