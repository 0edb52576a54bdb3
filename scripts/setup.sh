#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch, fastpar (editable) and the
# test/lint tools. Sourced by scripts/run_main.sh and scripts/run_tests.sh, so each of the
# README's two commands works on a fresh machine by itself.
#
# torch: an importable torch (say a CUDA build on a GPU machine; the venv sees the system
# site-packages) is kept as it is. Otherwise a machine with an NVIDIA driver gets the default
# (CUDA) wheel and a machine without one gets the CPU build, never a multi-GB CUDA download.
#
# Switches (docs/switches.md's table lists every one): FASTPAR_VENV (where the venv goes),
# FASTPAR_TORCH_CPU_VERSION / FASTPAR_TORCH_CPU_INDEX (the CPU wheel and its index),
# FASTPAR_NO_EXTENSION=1 (skip building fastpar._C).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FASTPAR_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_CPU_VERSION="${FASTPAR_TORCH_CPU_VERSION:-2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "fastpar setup: creating $VENV"
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

stamp_key="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/scripts/setup.sh" "$ROOT"/csrc/* 2>/dev/null | sha1sum | cut -c1-16)"
stamp="$VENV/.fastpar-setup-$stamp_key"
if [ -f "$stamp" ] && python -c "import fastpar, torch" 2>/dev/null; then
    return 0 2>/dev/null || exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
if python -c "import torch" 2>/dev/null; then
    echo "fastpar setup: keeping torch $(python -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "fastpar setup: NVIDIA GPU found, installing the default (CUDA) torch"
    python -m pip install "torch>=2.13"
else
    echo "fastpar setup: no GPU, installing the CPU build of torch $TORCH_CPU_VERSION"
    # The '+cpu' local version only matches a CPU wheel (a local file or PyTorch's CPU index);
    # it can never resolve to a CUDA build.
    python -m pip install "torch==${TORCH_CPU_VERSION}+cpu" \
        || python -m pip install "torch==${TORCH_CPU_VERSION}" \
            --index-url "${FASTPAR_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
fi
python -m pip install "setuptools>=77" ninja pybind11
# builds the C++ extension fastpar._C too (about a minute: torch's headers are large); a machine
# without a compiler still gets a working fastpar (FASTPAR_NO_EXTENSION=1 skips the build)
python -m pip install --no-build-isolation -e "$ROOT[test,lint,hf,bench,tensorboard,peers,peft]"
python -c "import torch, fastpar; print('fastpar setup: ok, fastpar', fastpar.__version__, 'torch', torch.__version__)"
rm -f "$VENV"/.fastpar-setup-*
touch "$stamp"
