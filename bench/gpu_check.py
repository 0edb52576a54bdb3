"""The GPU check: install, the GPU test tier and the kernel benchmarks, summarised in one folder.

    python bench/gpu_check.py OUTDIR [--budget SECONDS] [--all]

Written for a short lease on a bare GPU machine (torch, triton, pytest and pytest-benchmark
present, no network), inside ``--budget`` seconds (default 360, so a rerun fits too):

1. install: when ``fastpar.kernels`` does not import, ``pip install --no-deps
   --no-build-isolation -e .`` (builds ``fastpar._C`` with its CUDA kernels; nothing fetched);
2. the GPU tests: ``pytest -m cuda tests/``;
3. the benchmarks, one pytest run per file, in the order of ``KERNEL_BENCHES`` (the kernels'
   bandwidth figures first), each with its own JSON so a file that runs out of time loses only
   itself; ``--all`` then runs every other file under bench/ except the harness.

Writes into OUTDIR: ``install.log``, ``tests.log``, ``bench.log``, ``bench.json`` (the files'
pytest-benchmark JSON merged), ``results.json`` (a summary: each phase's status, the machine,
one entry per benchmark) and ``results.md`` (one table row per benchmark: name, median, HBM
bandwidth fraction where known). Exits 1 when the install or the GPU tests fail (or time out),
2 when there is no GPU, 0 otherwise; a failed or timed-out benchmark file is reported in the
files without failing the check.

``python bench/gpu_check.py --table BENCH_JSON OUTDIR`` writes only the two summaries from an
existing pytest-benchmark JSON file; ``--plan`` prints the commands without running them (both
work on any machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 360
INSTALL_LIMIT_S = 150
TEST_LIMIT_S = 150
GPU_TESTS = ["tests/"]  # what the GPU-tests phase hands pytest -m cuda
BENCH_OPTIONS: list[str] = []  # pytest-benchmark options of each benchmark run
MIN_BENCH_S = 20  # a benchmark file is not started with less than this left
# the kernels' benchmarks, most wanted first
KERNEL_BENCHES = [
    "test_bench_cross_entropy.py",
    "test_bench_fp8_cast.py",  # fp8 amax + cast + transposed copy (issue 47's core)
    "test_bench_train_gpu.py",  # a 1.7 B Llama's training step, bf16 and fp8: MFU (issue 47)
    "test_bench_unscale_norm.py",
    "test_bench_adamw.py",
    "test_bench_moe_permute.py",
    "test_bench_moe_overlap.py",
    "test_bench_moe_grouped.py",  # the dropless experts' grouped GEMM
]


def _run(cmd: list[str], log: Path, limit: float, append: bool = False) -> tuple[int | None, float]:
    """Run ``cmd`` in the repository root, output to ``log``; (exit code or None on timeout, s)."""
    start = time.monotonic()
    with log.open("a" if append else "w") as out:
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


def bench_files(everything: bool) -> list[str]:
    """Benchmark files in the order they run: the kernels first, then (``everything``) the
    rest of bench/ except the multi-rank harness."""
    files = list(KERNEL_BENCHES)
    if everything:
        rest = sorted(p.name for p in (ROOT / "bench").glob("test_bench_*.py"))
        files += [f for f in rest if f not in files and "harness" not in f]
    return files


def merge(parts: list[dict]) -> dict | None:
    """One pytest-benchmark JSON from several runs' (machine info of the first, all benchmarks)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    merged = dict(parts[0])
    merged["benchmarks"] = [b for p in parts for b in p.get("benchmarks", [])]
    return merged


def _version(dist_name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _installed() -> bool:
    probe = "import fastpar.kernels, fastpar.info"
    return (
        subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True).returncode == 0
    )


def plan(out: Path, everything: bool) -> list[tuple[str, list[str], Path]]:
    """(phase, command, log) in the order the check runs them."""
    py = sys.executable
    quiet = ["-q", "-p", "no:cacheprovider"]
    steps = [
        (
            "install",
            [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."],
            out / "install.log",
        ),
        ("gpu tests", [py, "-m", "pytest", "-m", "cuda", *GPU_TESTS, *quiet], out / "tests.log"),
    ]
    for f in bench_files(everything):
        json_path = out / "parts" / (Path(f).stem + ".json")
        # every benchmark of the file, not only pytest bench/'s quick selection (bench/conftest.py)
        cmd = [py, "-m", "pytest", f"bench/{f}", "-m", "full or not full", *quiet, *BENCH_OPTIONS]
        cmd.append(f"--benchmark-json={json_path}")
        steps.append((f"bench {f}", cmd, out / "bench.log"))
    return steps


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
    args = list(argv)
    everything = "--all" in args
    dry = "--plan" in args
    args = [a for a in args if a not in ("--all", "--plan")]
    budget = BUDGET_S
    if "--budget" in args:
        at = args.index("--budget")
        try:
            budget = float(args[at + 1])
        except (IndexError, ValueError):
            print("--budget needs a number of seconds", file=sys.stderr)
            return 2
        del args[at : at + 2]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(args[0]).resolve()
    steps = plan(out, everything)
    if dry:
        for phase, cmd, log in steps:
            print(f"{phase}: {' '.join(cmd)}  > {log.name}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no NVIDIA GPU visible to torch (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}); nothing run. Use a GPU "
            "machine, or run the CPU and interpreter tiers with scripts/run_tests.sh.",
            file=sys.stderr,
        )
        return 2
    deadline = time.monotonic() + budget
    out.mkdir(parents=True, exist_ok=True)
    (out / "parts").mkdir(exist_ok=True)
    (out / "bench.log").unlink(missing_ok=True)
    status: dict = {
        "device": torch.cuda.get_device_name(0),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
        "budget seconds": budget,
        "liger-kernel (a baseline)": _version("liger-kernel"),
    }
    ok = True
    parts = []
    for phase, cmd, log in steps:
        left = deadline - time.monotonic()
        if phase == "install":
            if _installed():
                status["install"] = "already importable, skipped"
                continue
            rc, secs = _run(cmd, log, min(INSTALL_LIMIT_S, left))
            good = rc == 0 and _installed()
            status["install"] = ("ok" if good else f"FAILED (exit {rc}, see install.log)") + (
                f", {secs:.0f} s"
            )
            if not good:
                ok = False
                break
        elif phase == "gpu tests":
            rc, secs = _run(cmd, log, min(TEST_LIMIT_S, left))
            passed = rc in (0, 5)  # 5: no test carries the cuda marker
            ok = ok and passed
            state = "passed" if passed else f"FAILED (exit {rc}, see tests.log)"
            if rc is None:
                state = f"TIMED OUT after {secs:.0f} s (see tests.log)"
            status["gpu tests"] = f"{state}, {secs:.0f} s"
        else:
            if left < MIN_BENCH_S:
                status[phase] = f"not run: {left:.0f} s of the budget left"
                continue
            rc, secs = _run(cmd, log, left, append=True)
            json_path = Path(cmd[-1].split("=", 1)[1])
            parts.append(_load(json_path))
            state = "ok" if rc == 0 else f"exit {rc} (see bench.log)"
            if rc is None:
                state = f"TIMED OUT after {secs:.0f} s: no JSON (see bench.log)"
            status[phase] = f"{state}, {secs:.0f} s"
    merged = merge(parts)
    if merged is not None:
        (out / "bench.json").write_text(json.dumps(merged, indent=2) + "\n")
    for part in (out / "parts").glob("*.json"):
        part.unlink()
    (out / "parts").rmdir()
    write_summaries(merged, out, status)
    print((out / "results.md").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
