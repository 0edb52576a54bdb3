"""fp8 scales of a split tensor (``fastpar.ops.fp8.quantize`` with ``group`` and ``split_dim``):
each rank quantizes its slice exactly as one device quantizes the whole tensor — the same
scales and the same fp8 bytes, sliced — for every recipe, role and split dim, the transposed
copy (the weight-gradient GEMM's operand) too. The largest value sits in rank 1's slice, so a
scale left unreduced differs on rank 0 (checked: the test can fail). Blocks of 128 are never
cut (each slice is a multiple of 128); one scale per tensor, and rows cut along their length,
are max-reduced over the group (issue 47, point 3)."""

from __future__ import annotations

import pytest
import torch
from _mesh import make_mesh

from fastpar.ops import fp8
from fastpar.testing import run_ranks

ROLES = ("activation", "weight", "grad")


def _full() -> torch.Tensor:
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(5))
    x[200, 400] = -37.0  # the tensor's max |x|: rank 1's slice along either dim
    return x


def _sliced(t: torch.Tensor | None, dim: int, rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s share of a whole tensor's data or scale grid along ``dim`` (a grid of one
    along ``dim``, or one scale, is every rank's)."""
    if t is None or t.dim() == 0 or t.shape[dim] == 1:
        return t
    return t.chunk(2, dim=dim)[rank]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    wide = a.dtype.itemsize == 1  # fp8: compare the bytes
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if wide else torch.equal(a, b)


def _slices_equal_the_whole(recipe: str) -> list[str]:
    mesh = make_mesh(tp=2)
    rank, full = mesh.tp_rank, _full()
    wrong = []
    for role in ROLES:
        whole = fp8.quantize(full, recipe, role, transpose=True)
        for dim in (0, 1):
            part = full.chunk(2, dim=dim)[rank].contiguous()
            got = fp8.quantize(
                part, recipe, role, transpose=True, group=mesh.tp_group, split_dim=dim
            )
            expected = (
                _sliced(whole.data, dim, rank),
                _sliced(whole.scale, dim, rank),
                _sliced(whole.data_t, 1 - dim, rank),
                _sliced(whole.scale_t, 1 - dim, rank),
            )
            for name, a, b in zip(
                ("data", "scale", "data_t", "scale_t"), got[:4], expected, strict=True
            ):
                if not _same(a, b):
                    wrong.append(f"{role} split {dim}: {name}")
            alone = fp8.quantize(part, recipe, role)  # no group: rank 0 misses the max
            if recipe == "tensorwise" and rank == 0 and _same(alone.scale, got.scale):
                wrong.append(f"{role} split {dim}: the unreduced scale equals the reduced one")
    try:  # a group without the dim it splits: refused, naming it
        fp8.quantize(full, recipe, "weight", group=mesh.tp_group)
        wrong.append("a group without split_dim was taken")
    except ValueError as exc:
        if "split_dim must be 0 or 1 with a group, got None" not in str(exc):
            wrong.append(f"refusal: {exc}")
    return wrong


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_each_rank_quantizes_its_slice_as_one_device_the_whole(recipe):
    assert run_ranks(_slices_equal_the_whole, 2, recipe) == [[], []]
