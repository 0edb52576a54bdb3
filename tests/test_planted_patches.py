"""scripts/planted/*.patch (the real bugs scripts/planted_faults.py plants, one at a time, to see
whether the CPU tier catches each) still apply to fastpar as it is: a change to the code they
patch must carry them along, or the fault tables silently stop measuring anything."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "scripts" / "planted").glob("*.patch"))


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_every_planted_fault_applies(patch):
    done = subprocess.run(
        ["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"


def test_there_are_planted_faults():
    assert len(PATCHES) >= 5
