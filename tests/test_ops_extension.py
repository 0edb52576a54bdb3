"""The C++/CUDA extension fastpar._C: the CUDA sources compile, the ops validate and pass
torch.library.opcheck, the all-to-all works over gloo, errors reach the caller."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpar.moe import overlap
from fastpar.ops import backend
from fastpar.testing import RankError, RankTimeout, run_ranks

CSRC = Path(__file__).resolve().parents[1] / "csrc"
built = pytest.mark.skipif(
    not overlap._extension_ops(),
    reason="fastpar._C is not built here (no compiler at install time)",
)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    for cu in sorted(CSRC.glob("*.cu")):
        out = subprocess.run(
            ["nvcc", "-arch=sm_90", "-O2", "-c", str(cu), "-o", str(tmp_path / (cu.stem + ".o"))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, f"{cu.name} does not compile:\n{out.stderr[-3000:]}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_pack_kernels_use_wide_words_and_no_per_word_division(tmp_path):
    """pack_kernels.cu compiled to PTX for sm_90: a copy kernel for each of the 16, 8, 4, 2 and
    1-byte words (rows of any width take the widest access that divides them and both base
    addresses) and at most two 64-bit divisions per kernel, one per row on each of its two
    paths (pack / unpack); the loop over a row's words divides nothing."""
    import re

    ptx = tmp_path / "pack_kernels.ptx"
    out = subprocess.run(
        ["nvcc", "-arch=sm_90", "-O2", "-ptx", str(CSRC / "pack_kernels.cu"), "-o", str(ptx)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = ptx.read_text()
    for load in ("v4.u32", "v2.u32", "u32", "u16", "u8"):
        assert re.search(rf"ld\.global(\.nc)?\.{re.escape(load)}\s", text), f"no {load} loads"
    kernels = re.findall(r"\.entry\s+(\w+)\((.*?)\n}", text, flags=re.S)
    assert len(kernels) == 5, [k[0] for k in kernels]
    for name, body in kernels:
        divisions = len(re.findall(r"\b(div|rem)\.[su]64\b", body))
        assert divisions <= 2, (name, divisions)


@pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("g++") is None, reason="nvcc or g++ is missing"
)
@pytest.mark.slow  # g++ parses torch's headers: about 25 s
def test_cuda_glue_compiles(tmp_path):
    """The CUDA branches of the .cpp binding files (FASTPAR_WITH_CUDA: device guards, streams,
    the extern "C" launchers), compiled for syntax against this torch's headers. A CPU wheel
    ships the c10/cuda headers but not the one CMake generates; a stub stands in for it. The
    files are checked as one translation unit (torch's headers parsed once: half the time); each
    also compiles alone in every build of the extension (their CPU branches)."""
    import sysconfig

    from torch.utils import cpp_extension

    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    homes = [os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda"]
    homes.append(str(Path(shutil.which("nvcc")).resolve().parent.parent))
    found = [Path(h) / "include" for h in homes if h]
    found = [d for d in found if (d / "cuda_runtime_api.h").is_file()]
    if not found:
        pytest.skip(f"no CUDA include folder with cuda_runtime_api.h under {homes}")
    cuda_include = found[0]
    flags = [f"-I{p}" for p in cpp_extension.include_paths()]
    flags += [f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}", f"-I{tmp_path}"]
    sources = [p for p in sorted(CSRC.glob("*.cpp")) if "FASTPAR_WITH_CUDA" in p.read_text()]
    assert sources, "no .cpp file has a CUDA branch"
    unit = tmp_path / "cuda_branches.cpp"
    unit.write_text("".join(f'#include "{cpp}"\n' for cpp in sources))
    out = subprocess.run(
        [
            "g++",
            "-std=c++20",
            "-w",
            "-fsyntax-only",
            "-DFASTPAR_WITH_CUDA",
            "-DTORCH_EXTENSION_NAME=_C",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            *flags,
            str(unit),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    names = ", ".join(p.name for p in sources)
    assert out.returncode == 0, f"{names} (CUDA branches) do not compile:\n{out.stderr[-3000:]}"


def test_info_reports_the_extension_and_the_transport():
    from fastpar.info import report

    text = report()
    _, status = backend.extension_status()
    assert f"extension fastpar._C {status}" in text
    assert f"moe all-to-all: {overlap.transport()}" in text


@built
def test_pack_unpack_ops():
    full = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    chunk = torch.ops.fastpar.pack_chunk(full, 1, 4)
    assert torch.equal(chunk, full[:, 1:4])
    dst = torch.zeros_like(full)
    torch.ops.fastpar.unpack_chunk(dst, chunk, 1)
    assert torch.equal(dst[:, 1:4], full[:, 1:4]) and dst[:, 0].abs().sum() == 0
    with pytest.raises(RuntimeError, match=r"rows \[3, 9\) are outside the capacity 5"):
        torch.ops.fastpar.pack_chunk(full, 3, 9)
    with pytest.raises(RuntimeError, match=r"expected an \[E, C, H\] buffer"):
        torch.ops.fastpar.pack_chunk(full.view(10, 3), 0, 1)
    with pytest.raises(RuntimeError, match=r"chunk \[2, 3, 2\] does not fit buffer \[2, 5, 3\]"):
        torch.ops.fastpar.unpack_chunk(dst, torch.zeros(2, 3, 2), 0)
    with pytest.raises(RuntimeError, match="chunk is Double on cpu but the buffer is Float on cpu"):
        torch.ops.fastpar.unpack_chunk(dst, chunk.double(), 1)
    with pytest.raises(RuntimeError, match=r"rows \[4, 7\) are outside the capacity 5"):
        torch.ops.fastpar.unpack_chunk(dst, chunk, 4)


@pytest.mark.cuda
@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize(
    "hidden,offset",
    [(64, 0), (3, 0), (2, 0), (6, 0), (64, 1), (63, 1)],
    ids=["16B-words", "odd-rows", "8B-words", "12B-rows", "misaligned", "misaligned-odd"],
)
def test_pack_unpack_cuda_kernels(dtype, hidden, offset):
    """pack_kernels.cu on the GPU equals slicing, for rows of 16-byte words, rows that only 8,
    4 or 2-byte words divide, and a buffer whose address is not 16-byte aligned (narrower words,
    down to single bytes for uint8)."""
    if not torch.ops.fastpar.pack_chunk.default.has_kernel_for_dispatch_key("CUDA"):
        pytest.fail("fastpar._C was built without its CUDA kernels on a machine with a GPU")
    e, c = 3, 37
    base = torch.randn(offset + e * c * hidden, device="cuda").to(dtype)
    full = base[offset:].view(e, c, hidden)
    for c0, c1 in [(0, c), (5, 17), (36, 37), (4, 4)]:
        chunk = torch.ops.fastpar.pack_chunk(full, c0, c1)
        assert chunk.is_cuda and torch.equal(chunk, full[:, c0:c1])
        dst = torch.zeros_like(full)
        torch.ops.fastpar.unpack_chunk(dst, chunk, c0)
        want = torch.zeros_like(full)
        want[:, c0:c1] = full[:, c0:c1]
        assert torch.equal(dst, want)
    torch.library.opcheck(torch.ops.fastpar.pack_chunk.default, (full, 2, 9))
    torch.library.opcheck(
        torch.ops.fastpar.unpack_chunk.default, (full.clone(), full[:, :4].contiguous(), 2)
    )


@built
def test_opcheck_pack_ops():
    full = torch.randn(3, 8, 4)
    torch.library.opcheck(torch.ops.fastpar.pack_chunk.default, (full, 2, 6))
    torch.library.opcheck(
        torch.ops.fastpar.unpack_chunk.default, (full.clone(), torch.randn(3, 4, 4), 2)
    )


def _opcheck_all_to_all() -> int:
    overlap._extension_ops()
    name = dist.distributed_c10d._get_default_group().group_name
    args = (torch.randn(4, 3), [], [], name)
    torch.library.opcheck(torch.ops.fastpar.all_to_all.default, args)
    # every check, the aliasing ones included: no output aliases an input (torch.compile's
    # buffer reuse relies on it; CI runs AOT's aliasing check as an error)
    torch.library.opcheck(torch.ops.fastpar.all_to_all_start.default, args)
    ticket = torch.ops.fastpar.all_to_all_start(*args)
    # opcheck runs an op on copies of its arguments, and a copy of a ticket is not a ticket (a
    # clear error, tests/test_ops_extension_compile.py), so wait is checked as a part: inside
    # all_to_all above, under torch.compile with the aliasing check as an error
    # (tests/test_ops_extension_compile.py), and its fake against the real op here
    with FakeTensorMode() as mode:
        fake_x = mode.from_tensor(args[0])
        fake_ticket = torch.ops.fastpar.all_to_all_start(fake_x, *args[1:])
        fake = torch.ops.fastpar.all_to_all_wait(fake_ticket, fake_x, [])
    assert (fake_ticket.shape, fake_ticket.dtype) == (ticket.shape, ticket.dtype)
    out = torch.ops.fastpar.all_to_all_wait(ticket, args[0], [])
    assert torch.equal(out, args[0])  # one rank: its own rows back
    assert (fake.shape, fake.dtype, fake.stride()) == (out.shape, out.dtype, out.stride())
    assert out.untyped_storage().data_ptr() != ticket.untyped_storage().data_ptr()
    return 0


@built
def test_opcheck_all_to_all():
    # the op starts a collective, so run it on a one-rank gloo world (it completes at once)
    run_ranks(_opcheck_all_to_all, 1)


def _bad_splits() -> None:
    name = dist.distributed_c10d._get_default_group().group_name
    torch.ops.fastpar.all_to_all_start(torch.empty(4, 2), [2, 2], [3, 0], name)


@built
def test_bad_splits_are_clear_errors():
    with pytest.raises(RankError, match="input split sizes add up to 3 but the tensor has 4 rows"):
        run_ranks(_bad_splits, 2)


def _uneven() -> list:
    overlap._extension_ops()
    rank, world = dist.get_rank(), dist.get_world_size()
    name = dist.distributed_c10d._get_default_group().group_name
    # rank r sends r + 1 + j rows to rank j
    in_splits = [rank + 1 + j for j in range(world)]
    out_splits = [s + 1 + rank for s in range(world)]
    x = torch.cat([torch.full((n, 2), float(10 * rank + j)) for j, n in enumerate(in_splits)])
    ticket = torch.ops.fastpar.all_to_all_start(x, out_splits, in_splits, name)
    out = torch.ops.fastpar.all_to_all_wait(ticket, x, out_splits)
    return out[:, 0].tolist()


@built
def test_uneven_all_to_all_over_gloo():
    out = run_ranks(_uneven, 3)
    for rank, rows in enumerate(out):
        want = [float(10 * s + rank) for s in range(3) for _ in range(s + 1 + rank)]
        assert rows == want


def _peer_dies() -> None:
    overlap._extension_ops()
    name = dist.distributed_c10d._get_default_group().group_name
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed before the all-to-all")
    x = torch.ones(4, 2)
    torch.ops.fastpar.all_to_all_wait(torch.ops.fastpar.all_to_all_start(x, [], [], name), x, [])


@built
def test_error_on_one_rank_reaches_the_caller_without_a_hang():
    with pytest.raises(RankError) as info:
        run_ranks(_peer_dies, 2, timeout=60)
    assert not isinstance(info.value, RankTimeout)
    assert "rank 1 failed before the all-to-all" in str(info.value)


def test_csrc_sources_have_distinct_stems():
    """One object file per source stem: a .cpp and a .cu of the same stem (pack.cpp / pack.cu)
    make ninja refuse the CUDA build ("multiple rules generate csrc/pack.o")."""
    import pathlib

    csrc = pathlib.Path(__file__).parents[1] / "csrc"
    stems = [p.stem for p in csrc.glob("**/*") if p.suffix in (".cpp", ".cu")]
    assert stems and len(stems) == len(set(stems)), sorted(stems)


def test_an_extension_built_for_another_torch_is_not_loaded(tmp_path, monkeypatch):
    """Loading fastpar._C built against torch 2.13 under torch 2.14 crashed the process
    (SIGSEGV): setup.py records the torch it built against and the loader refuses a mismatch."""
    import json

    import torch

    from fastpar.ops import backend

    info = tmp_path / "_C_build.json"
    monkeypatch.setattr(backend, "BUILD_INFO", info)
    try:
        info.write_text(json.dumps({"torch": "0.0.1", "cuda": False}))
        backend.extension_status.cache_clear()
        ok, text = backend.extension_status()
        assert not ok
        assert f"built against torch 0.0.1, this is torch {torch.__version__}; rebuild" in text
        info.write_text(json.dumps({"torch": torch.__version__, "cuda": False}))
        backend.extension_status.cache_clear()
        assert backend.extension_status()[1] != text  # the same torch: no refusal for that
    finally:
        backend.extension_status.cache_clear()  # the real status for later tests
