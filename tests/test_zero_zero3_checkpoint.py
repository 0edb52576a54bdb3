"""ZeRO-3's checkpoint state (``fastpar.zero.Zero3``): ``state_dict`` saved after 2 steps and
loaded into a fresh model (another init) continues bit for bit, fp16 loss scale included; the
checkpoint pieces (each element of every parameter and optimizer state exported by exactly one
DP rank) rebuilt into a fresh model continue bit for bit; a state of another layout is refused.
Bit-for-bit equality holds: both sides run the same kernels in the same order."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _zero3 import Block, Net, batch, full_params, make_opt

from fastpar.amp import DynamicLossScaler
from fastpar.optim import FusedAdamW
from fastpar.testing import RankError, run_ranks
from fastpar.zero import Zero3


def _resume() -> bool:
    """Save the sharded state after 2 steps, continue 2 steps; a fresh Zero3 loading the
    state continues bit-identically."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def build(seed: int):
        torch.manual_seed(seed)
        return Zero3(
            Net().half(),
            lambda ps: FusedAdamW(ps, lr=1e-2),
            wrap=(Block,),
            persist_below=20,
            scaler=DynamicLossScaler(initial_scale=64.0, growth_interval=2),
            max_grad_norm=1.0,
        )

    def run(model, steps):
        losses = []
        for step in steps:
            x, y = batch(step, 1, world)
            loss = F.mse_loss(model(x[0, rank].half()).float(), y[0, rank])
            model.scale_loss(loss).backward()
            model.step()
            model.zero_grad()
            losses.append(loss.item())
        return losses

    model = build(0)
    run(model, range(2))
    state = copy.deepcopy(model.state_dict())
    losses = run(model, range(2, 4))
    model2 = build(1)  # another init: everything comes from the state
    model2.load_state_dict(state)
    losses2 = run(model2, range(2, 4))
    same = all(
        torch.equal(a, b) for a, b in zip(full_params(model), full_params(model2), strict=True)
    )
    return same and losses == losses2 and float(model.scaler.scale) == float(model2.scaler.scale)


def test_state_dict_resumes_bit_identically():
    assert run_ranks(_resume, 2) == [True, True]


def _pieces(opt_name: str) -> bool:
    """Export checkpoint pieces, rebuild full local tensors from every rank's pieces, load them
    into a fresh Zero3 (other init), continue: identical to the original continuing."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def build(seed: int):
        torch.manual_seed(seed)
        net = Net()
        shapes = [p.shape for p in net.parameters()]
        model = Zero3(net, lambda ps: make_opt(opt_name, ps), min_params=150, persist_below=20)
        return model, shapes

    def run(model, steps):
        for step in steps:
            x, y = batch(step, 1, world)
            F.mse_loss(model(x[0, rank]), y[0, rank]).backward()
            model.step()
            model.zero_grad()

    model, shapes = build(0)
    run(model, range(2))
    index = {id(p): i for i, p in enumerate(model.module.parameters())}
    mine = [
        (index[id(p)], key, piece.clone(), a, z)
        for p, key, piece, a, z in model.checkpoint_pieces()
    ]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    full: dict[tuple[int, str], torch.Tensor] = {}
    count: dict[tuple[int, str], torch.Tensor] = {}
    for pieces in everyone:
        for i, key, piece, a, z in pieces:
            n = 1 if key == "step" else shapes[i].numel()
            full.setdefault((i, key), torch.zeros(n))[a:z] = piece
            count.setdefault((i, key), torch.zeros(n, dtype=torch.int64))[a:z] += 1
    # every element of every parameter and state is exported by exactly one DP rank
    keys = (
        {"param", "momentum_buffer"}
        if opt_name == "sgd"
        else {"param", "exp_avg", "exp_avg_sq", "step"}
    )
    assert {k for _, k in full} == keys
    assert len(full) == len(shapes) * len(keys)
    assert all(bool((c == 1).all()) for c in count.values())
    run(model, range(2, 4))

    model2, _ = build(1)
    index2 = {id(p): i for i, p in enumerate(model2.module.parameters())}

    def lookup(p, key):
        t = full.get((index2[id(p)], key))
        if t is None:
            return None
        return t.reshape(()) if key == "step" else t.reshape(shapes[index2[id(p)]])

    model2.load_checkpoint_pieces(lookup)
    run(model2, range(2, 4))
    return all(
        torch.equal(a, b) for a, b in zip(full_params(model), full_params(model2), strict=True)
    )


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_checkpoint_pieces_round_trip(opt_name):
    assert run_ranks(_pieces, 2, opt_name) == [True, True]


def _wrong_layout() -> None:
    model = Zero3(Net(), lambda ps: torch.optim.SGD(ps, lr=0.1), wrap=(Block,))
    state = model.state_dict()
    state["dp_rank"] = 1 - state["dp_rank"]
    model.load_state_dict(state)


def test_state_dict_refuses_another_layout():
    with pytest.raises(RankError, match="loads only into the same layout"):
        run_ranks(_wrong_layout, 2)
