"""Plant real bugs in fastpar, one at a time, and see whether the CI tier catches each, and how
fast: for every ``scripts/planted/*.patch`` (a small diff of ``fastpar/``: a dropped reduction,
a wrong group, a mean of means, ...), a copy of this checkout with the patch applied runs the
CPU tier (``pytest -x``: it stops at the first failure) and the row says which test failed
first and after how many seconds.

    python scripts/planted_faults.py                       # every patch, a markdown table
    python scripts/planted_faults.py cp-loss-mean-of-means  # one (its file name, no .patch)
    python scripts/planted_faults.py --timeout 900 -- tests/test_zero_zero3.py   # a narrower run

Run it from the repository's venv (``source .venv/bin/activate``). Each copy is a ``git
worktree`` of HEAD (uncommitted changes are not in it) with the built extension copied in;
``PYTHONPATH`` makes the copy's fastpar the one imported, in forked ranks and subprocesses too.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = os.path.join(ROOT, "scripts", "planted")


def _worktree(where: str) -> None:
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", "-q", where, "HEAD"], check=True
    )
    for built in glob.glob(os.path.join(ROOT, "fastpar", "_C*")):
        shutil.copy2(built, os.path.join(where, "fastpar"))


def _first_failure(text: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    return m.group(1) if m else ""


def run_one(patch: str, timeout: float, selection: list[str]) -> dict:
    name = os.path.basename(patch).removesuffix(".patch")
    where = tempfile.mkdtemp(prefix=f"fastpar-planted-{name}-")
    os.rmdir(where)
    _worktree(where)
    try:
        subprocess.run(["git", "-C", where, "apply", patch], check=True)
        env = {**os.environ, "PYTHONPATH": where, "FASTPAR_DEBUG_CHECKS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not cuda and not interpreter",
            *(selection or ["tests"]),
        ]
        began = time.monotonic()
        try:
            r = subprocess.run(
                cmd, cwd=where, env=env, capture_output=True, text=True, timeout=timeout
            )
            out, code = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else "", None
        seconds = time.monotonic() - began
        caught = code not in (0, None, 5)
        return {
            "fault": name,
            "caught": "yes" if caught else ("timed out" if code is None else "NO"),
            "by": _first_failure(out) if caught else "",
            "seconds": round(seconds),
        }
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", where], check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("faults", nargs="*", help="patch names (default: every one)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per fault (1800)")
    ap.add_argument("selection", nargs=argparse.REMAINDER, help="after --: pytest paths")
    args = ap.parse_args(argv)
    selection = [a for a in args.selection if a != "--"]
    patches = sorted(glob.glob(os.path.join(PATCHES, "*.patch")))
    if args.faults:
        known = {os.path.basename(p).removesuffix(".patch"): p for p in patches}
        missing = [f for f in args.faults if f not in known]
        if missing:
            ap.error(f"no patch named {missing}; the patches: {sorted(known)}")
        patches = [known[f] for f in args.faults]
    rows = []
    print("| planted fault | caught | first failing test | seconds |")
    print("| --- | --- | --- | --- |")
    for patch in patches:
        row = run_one(patch, args.timeout, selection)
        rows.append(row)
        print(
            f"| {row['fault']} | {row['caught']} | `{row['by']}` | {row['seconds']} |", flush=True
        )
    return 0 if all(r["caught"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
