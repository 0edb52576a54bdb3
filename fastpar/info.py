"""``python -m fastpar.info``: versions, device, extension, and the backend each op will use.

It prints a ``warning`` line for torch or Triton outside ``TESTED``, the range the test suite
runs on (pyproject.toml requires at least its lower ends).
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import sys

import torch

import fastpar
from fastpar.ops import backend

# (oldest, newest) major.minor the suite is run on: torch 2.13 + Triton 3.9 in CI, and torch
# 2.14 + Triton 3.8, torch 2.13 + Triton 3.8 by hand (interpreter tier, packaging tests).
TESTED = {"torch": ((2, 13), (2, 14)), "triton": ((3, 8), (3, 9))}


def _installed(package: str) -> str | None:
    """The installed version of ``package`` without importing it, or None."""
    if package == "torch":
        return str(torch.__version__)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_warnings(versions: dict[str, str | None]) -> list[str]:
    """A ``warning`` line for each installed package (name → version, None: absent) outside
    ``TESTED``."""
    lines = []
    for name, version in versions.items():
        if version is None:
            continue
        (lo, hi), found = TESTED[name], re.match(r"(\d+)\.(\d+)", version)
        if found and lo <= (int(found[1]), int(found[2])) <= hi:
            continue
        lines.append(
            f"warning   {name} {version} is outside the range fastpar is tested on, "
            f"{name} {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}: install one of those if anything fails"
        )
    return lines


def _moe_transport() -> str:
    from fastpar.moe.overlap import transport

    try:
        return transport()
    except (RuntimeError, ValueError) as exc:
        return f"error: {exc}"


def report() -> str:
    """The text ``python -m fastpar.info`` prints."""
    _, triton_text = backend.triton_status()
    _, ext_text = backend.extension_status()
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    if dev_type == "cuda":
        device = f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible)"
    else:
        device = (
            f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        )
    lines = [
        f"fastpar   {fastpar.__version__}",
        f"python    {sys.version.split()[0]} ({platform.platform()})",
        f"torch     {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"triton    {triton_text}",
        f"device    {device}",
        f"extension fastpar._C {ext_text}; moe all-to-all: {_moe_transport()}",
        f"backends  distributed={'yes' if torch.distributed.is_available() else 'no'}"
        f" gloo={'yes' if torch.distributed.is_gloo_available() else 'no'}"
        f" nccl={'yes' if torch.distributed.is_nccl_available() else 'no'}",
        *version_warnings({name: _installed(name) for name in TESTED}),
        "",
    ]
    ops = backend.registered_ops()
    if not ops:
        lines.append("ops       none registered yet")
    else:
        lines.append(f"{'op':<32} {'implements':<28} runs on {dev_type} as")
        for name, info in sorted(ops.items()):
            try:
                chosen = backend.select(name, dev_type)
            except (ValueError, RuntimeError) as exc:
                chosen = f"error: {exc}"
            lines.append(f"{name:<32} {','.join(info.backends):<28} {chosen}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
