"""Shared set-up for ``pytest bench/``: every saved result records device, versions and commit.

Run:  pytest bench/ --benchmark-json=bench/results/<name>.json
"""

from __future__ import annotations

import subprocess

import torch

import fastpar


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        return "unknown"


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["fastpar"] = fastpar.__version__
    machine_info["torch"] = torch.__version__
    machine_info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    machine_info["commit"] = _commit()
