"""``python -m fastpar.info``: versions, device, extension, and the backend each op will use."""

from __future__ import annotations

import platform
import sys

import torch

import fastpar
from fastpar.ops import backend


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
    if torch.cuda.is_available():
        device, dev_type = (
            f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible)",
            "cuda",
        )
    else:
        device, dev_type = (
            f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "cpu",
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
