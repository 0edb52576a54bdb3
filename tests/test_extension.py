"""The C++/CUDA extension fastpar._C: the CUDA sources compile, the ops validate and pass
torch.library.opcheck, the all-to-all works over gloo, errors reach the caller."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

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
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, f"{cu.name} does not compile:\n{out.stderr[-3000:]}"


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
    # the asynchronous form returns a fresh ticket per call by design, so eager and traced
    # outputs cannot match: every other check applies
    torch.library.opcheck(
        torch.ops.fastpar.all_to_all_start.default, args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )  # fmt: skip
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
    out, ticket = torch.ops.fastpar.all_to_all_start(x, out_splits, in_splits, name)
    torch.ops.fastpar.all_to_all_wait(ticket)
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
    _, ticket = torch.ops.fastpar.all_to_all_start(torch.ones(4, 2), [], [], name)
    torch.ops.fastpar.all_to_all_wait(ticket)


@built
def test_error_on_one_rank_reaches_the_caller_without_a_hang():
    with pytest.raises(RankError) as info:
        run_ranks(_peer_dies, 2, timeout=60)
    assert not isinstance(info.value, RankTimeout)
    assert "rank 1 failed before the all-to-all" in str(info.value)
