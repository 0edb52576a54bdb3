"""``SharedKeyLinear``: the dense linear's output bit for bit, its own parameters under the same
names (marked replicated over TP), and backward the gradient of its last ``features`` outputs
summed over the TP group while the other outputs' gradient stays this rank's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh

from fastpar.nn import param_layout
from fastpar.nn.shared_key import SharedKeyLinear
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree


def _grads(features: int | None) -> None:
    mesh = make_mesh(tp="world")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dense = torch.nn.Linear(7, 9)
    x = torch.randn(3, 5, 7)
    g = torch.Generator().manual_seed(1)
    grads = torch.randn(world, 3, 5, 9, generator=g)  # each rank's heads: their own gradient
    k = 9 if features is None else features
    refs = []  # the dense layer fed the gradient it gets unsplit: fp32, then float64
    for dtype in (torch.float32, torch.float64):
        ref = torch.nn.Linear(7, 9, dtype=dtype)
        ref.load_state_dict(dense.state_dict())
        xr = x.to(dtype, copy=True).requires_grad_()
        want = grads[rank].to(dtype, copy=True)
        want[..., 9 - k :] = grads[..., 9 - k :].to(dtype).sum(0)  # the key: every rank's heads
        ref(xr).backward(want)
        refs.append((xr.grad, ref.weight.grad, ref.bias.grad))

    layer = SharedKeyLinear.from_dense(dense, features=features, mesh=mesh)
    assert layer.weight is dense.weight and layer.bias is dense.bias  # no copy
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert all(param_layout(p).kind == "replicated" for p in layer.parameters())
    xo = x.clone().requires_grad_()
    y = layer(xo)
    assert torch.equal(y, F.linear(x, dense.weight, dense.bias))  # identity forward
    y.backward(grads[rank])
    n = 15 * world  # the longest sum: the key's gradient over the tokens of every rank
    for name, got, single, exact in zip(
        ("input", "weight", "bias"),
        (xo.grad, layer.weight.grad, layer.bias.grad),
        *refs,
        strict=True,
    ):
        assert_agree(got, single, exact, length=n, what=f"grad of {name}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("features", [3, None], ids=["last3", "whole"])
def test_shared_key_gradient_is_summed_over_tp(world, features):
    run_ranks(_grads, world, features)


def test_bad_features_are_refused():
    linear = torch.nn.Linear(4, 6)
    for bad in (0, 7, -1):
        with pytest.raises(ValueError, match=r"features=.* must be in 1\.\.6"):
            SharedKeyLinear.from_dense(linear, features=bad)
    with pytest.raises(TypeError, match="features must be an int"):
        SharedKeyLinear.from_dense(linear, features=2.0)
    with pytest.raises(TypeError, match=r"needs an nn\.Linear"):
        SharedKeyLinear.from_dense(torch.nn.Embedding(3, 4), features=2)
    layer = SharedKeyLinear(4, 6, features=2)  # built from scratch: nn.Linear's init
    assert layer(torch.randn(2, 4)).shape == (2, 6) and layer.group is None
