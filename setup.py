"""Build script: packages, plus the optional C++/CUDA extension ``fastpar._C``.

The extension is built from ``csrc/``: every ``*.cpp`` always, every ``*.cu`` only when the
installed torch has CUDA and ``nvcc`` is on the PATH. When ``csrc/`` holds no sources there is
nothing to build and fastpar installs as pure Python (every op then has a Python path).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def _extension_modules() -> tuple[list, dict]:
    cpp = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("**/*.cpp"))
    cu = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("**/*.cu"))
    if not cpp and not cu:
        return [], {}
    if os.environ.get("FASTPAR_NO_EXTENSION") == "1":
        print("fastpar: FASTPAR_NO_EXTENSION=1, skipping the C++/CUDA extension")
        return [], {}
    import torch
    from torch.utils import cpp_extension

    with_cuda = bool(cu) and torch.version.cuda is not None and shutil.which("nvcc") is not None
    sources = cpp + (cu if with_cuda else [])
    macros = [("FASTPAR_WITH_CUDA", "1")] if with_cuda else []
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    ext = kind(
        name="fastpar._C",
        sources=sources,
        define_macros=macros,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},  # the C++ standard: torch's own
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


packages = find_packages(include=["fastpar", "fastpar.*"])
packages += ["fastpar.kernels"] + ["fastpar.kernels." + p for p in find_packages(where="kernels")]
ext_modules, cmdclass = _extension_modules()

setup(
    packages=packages,
    package_dir={"fastpar.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
