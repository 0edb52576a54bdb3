"""Build script: packages, plus the optional C++/CUDA extension ``fastpar._C``.

The extension is built from ``csrc/``: every ``*.cpp`` always, every ``*.cu`` only when the
installed torch has CUDA and ``nvcc`` is on the PATH. When ``csrc/`` holds no sources there is
nothing to build and fastpar installs as pure Python (every op then has a Python path).
"""

from __future__ import annotations

import json
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

    with_cuda = bool(cu) and torch.version.cuda is not None and shutil.which("nvcc") is not None
    if with_cuda:
        _find_cuda_home()
    from torch.utils import cpp_extension  # reads CUDA_HOME when imported

    sources = cpp + (cu if with_cuda else [])
    stems = [Path(s).stem for s in sources]
    clashes = sorted({s for s in stems if stems.count(s) > 1})
    if clashes:  # one object file per stem: ninja refuses two rules for csrc/<stem>.o
        raise SystemExit(f"fastpar: csrc sources share a file stem {clashes}: rename one of each")
    if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # no GPU to ask for its architecture (a build machine): Ampere and Hopper
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    # the torch the extension is built against: fastpar refuses to load it under another one
    build_info = {"torch": torch.__version__, "cuda": with_cuda}
    (ROOT / "fastpar" / "_C_build.json").write_text(json.dumps(build_info) + "\n")
    macros = [("FASTPAR_WITH_CUDA", "1")] if with_cuda else []
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    ext = kind(
        name="fastpar._C",
        sources=sources,
        define_macros=macros,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},  # the C++ standard: torch's own
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


def _find_cuda_home() -> None:
    """torch guesses the CUDA toolkit from ``which nvcc`` (its grandparent directory); where
    that holds no CUDA headers (nvcc a wrapper script or a symlink elsewhere), point CUDA_HOME at
    a directory that does."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    guesses = [Path(nvcc).parent.parent, Path(os.path.realpath(nvcc)).parent.parent]
    guesses += [Path("/usr/local/cuda")]
    if (guesses[0] / "include" / "cuda_runtime_api.h").exists():
        return
    for home in guesses[1:]:
        if (home / "include" / "cuda_runtime_api.h").exists():
            os.environ["CUDA_HOME"] = str(home)
            print(f"fastpar: CUDA_HOME={home} (the CUDA headers nvcc's own directory lacks)")
            return


packages = find_packages(include=["fastpar", "fastpar.*"])
ext_modules, cmdclass = _extension_modules()

setup(
    packages=packages,
    package_data={"fastpar": ["_C_build.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
