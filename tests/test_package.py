"""Packaging: import without Triton or a compiler, ``python -m fastpar.info``, backend selection."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fastpar.ops import backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py(code, cwd=None):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_does_not_import_triton_or_the_extension():
    out = _py("import sys, fastpar; print('triton' in sys.modules, 'fastpar._C' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_import_and_info_without_triton():
    """As if Triton were not installed. The blocker raises ModuleNotFoundError, what a missing
    module raises: torch >= 2.14 probes ``importlib.util.find_spec("triton")`` while it is
    imported and treats that error (only that one) as "not installed"."""
    out = _py(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError("triton blocked for this test", name=name)
        sys.meta_path.insert(0, Block())
        import fastpar
        from fastpar.info import report
        print(report())
        print("triton" in sys.modules)
        """
    )
    assert "triton    not available (ModuleNotFoundError: triton blocked for this test)" in out
    assert out.split()[-1] == "False"


def test_info_command_reports_versions():
    out = subprocess.run(
        [sys.executable, "-m", "fastpar.info"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    import torch

    import fastpar

    assert f"fastpar   {fastpar.__version__}" in out.stdout
    assert f"torch     {torch.__version__}" in out.stdout
    assert f"python    {sys.version.split()[0]}" in out.stdout
    assert "extension fastpar._C " in out.stdout
    assert "device    " in out.stdout


def test_kernels_are_a_subpackage_and_nothing_shadows_the_kernels_package():
    """fastpar's Triton kernels are ``fastpar.kernels``; neither the install nor the source
    tree holds a top-level ``kernels`` (transformers >= 5.25 imports the ``kernels`` package: a
    folder of that name at the root would shadow it for every command run from a checkout)."""
    out = _py(
        """
        import importlib.util, fastpar.kernels
        spec = importlib.util.find_spec("kernels")
        print(spec is None or "fastpar" not in str(spec.origin), fastpar.kernels.__name__)
        """,
        cwd=ROOT,  # from the checkout's root, as the README's commands run
    )
    assert out.split() == ["True", "fastpar.kernels"]
    assert not os.path.exists(os.path.join(ROOT, "kernels"))


@pytest.mark.skipif(not backend.triton_status()[0], reason="Triton is not installed here")
def test_forcing_triton_on_cpu_is_allowed(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    backend.register_op("test_only_op2", ("triton", "reference"))
    try:
        with backend.use_backend("triton"):
            assert backend.select("test_only_op2", "cpu") == "triton"
    finally:
        backend._OPS.pop("test_only_op2", None)


@pytest.mark.slow  # the mesh CLI in subprocesses: about 8 s
def test_mesh_cli(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastpar.mesh",
            "--world-size",
            "16",
            "--tp",
            "2",
            "--pp",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    import json

    doc = json.loads(out.stdout)
    assert doc["groups"]["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    full = {"dp-shard": 2, "dp-replicate": 1}  # no --dp-shard: full sharding, dp x 1
    assert doc["sizes"] == {"tp": 2, "cp": 1, "pp": 4, "dp": 2, "ep": 1, "expert-dp": 2, **full}
    coords = {"tp": 1, "pp": 1, "dp": 0, "cp": 0, "ep": 0, "expert-dp": 0}
    assert doc["ranks"][5] == {**coords, "dp-shard": 0, "dp-replicate": 0}
    bad = subprocess.run(
        [sys.executable, "-m", "fastpar.mesh", "--world-size", "12", "--tp", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "error: world_size 12 is not divisible by tp*pp = 5*1" in bad.stderr
    env = dict(os.environ)
    chk = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastpar.mesh",
            "--world-size",
            "8",
            "--tp",
            "2",
            "--pp",
            "2",
            "--ep",
            "2",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert chk.returncode == 0, chk.stderr
    assert "check ok: 8 gloo ranks created every group" in chk.stdout


def test_version_warnings_outside_the_tested_range():
    from fastpar.info import version_warnings

    assert version_warnings({"torch": "2.13.0+cpu", "triton": "3.9.0"}) == []
    assert version_warnings({"torch": "2.14.1+cu130", "triton": "3.8.0"}) == []
    assert version_warnings({"torch": "2.13.0", "triton": None}) == []  # Triton is optional
    lines = version_warnings({"torch": "2.12.1", "triton": "3.10.0"})
    assert lines == [
        "warning   torch 2.12.1 is outside the range fastpar is tested on, torch 2.13 to 2.14: "
        "install one of those if anything fails",
        "warning   triton 3.10.0 is outside the range fastpar is tested on, triton 3.8 to 3.9: "
        "install one of those if anything fails",
    ]
    assert len(version_warnings({"torch": "2.15.0.dev20270101", "triton": "nightly"})) == 2


def test_info_warns_about_an_untested_torch():
    out = _py(
        """
        import torch
        torch.__version__ = "2.12.0"
        from fastpar.info import report
        print(report())
        """
    )
    assert (
        "\nwarning   torch 2.12.0 is outside the range fastpar is tested on, torch 2.13 to" in out
    )


def test_pyproject_requires_the_oldest_tested_versions():
    """The lower bounds in pyproject.toml are the oldest releases in fastpar.info.TESTED."""
    import re
    from pathlib import Path

    from fastpar.info import TESTED

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    for name, ((major, minor), _) in TESTED.items():
        found = re.findall(rf'"{name}>=([0-9.]+)[";]', text)
        assert found == [f"{major}.{minor}"], (name, found)
