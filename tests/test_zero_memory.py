"""The ZeRO memory planner against the paper's Table 1, and against bytes actually held."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastpar.parallel import DistributedDataParallel
from fastpar.testing import run_ranks
from fastpar.zero import ZeroOptimizer, estimate_memory, held_bytes

# Rajbhandari et al., "ZeRO" (2020), Table 1: GB per device, K = 12, columns baseline / Pos /
# Pos+g / Pos+g+p.
TABLE_1 = {
    (7.5e9, 1): (120, 120, 120, 120),
    (7.5e9, 4): (120, 52.5, 41.3, 30),
    (7.5e9, 16): (120, 35.6, 21.6, 7.5),
    (7.5e9, 64): (120, 31.4, 16.6, 1.88),
    (7.5e9, 256): (120, 30.4, 15.4, 0.47),
    (7.5e9, 1024): (120, 30.1, 15.1, 0.12),
    (128e9, 1): (2048, 2048, 2048, 2048),
    (128e9, 64): (2048, 536, 284, 32),
    (128e9, 1024): (2048, 513, 258, 2),
    (1e12, 64): (16000, 4187, 2218, 250),
    (1e12, 1024): (16000, 4011, 2013, 15.6),
}


@pytest.mark.parametrize("psi,n", list(TABLE_1))
def test_paper_table_1(psi, n):
    got = [estimate_memory(psi, n, stage).total / 1e9 for stage in range(4)]
    for g, want in zip(got, TABLE_1[psi, n], strict=True):
        assert g == pytest.approx(want, rel=6e-3, abs=6e-3)  # the table rounds to 3 digits


def test_fields_and_errors():
    e = estimate_memory(1000, 4, 2)
    assert (e.params, e.grads, e.optimizer) == (2000, 500, 3000)
    assert e.total == 5500
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        estimate_memory(10, 2, 4)
    with pytest.raises(ValueError, match="mode must be"):
        estimate_memory(10, 2, 1, mode="guess")


def _model():
    return nn.Sequential(nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 17))


def _measure(stage: int) -> tuple[dict, dict, float, int]:
    torch.manual_seed(0)
    model = _model()
    psi = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, 33)
    if stage == 0:
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters())
        ddp(x).sum().backward()
        opt.step()
        held = held_bytes(model.parameters(), opt)
        plan = estimate_memory(
            psi,
            dist.get_world_size(),
            0,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=8,
            mode="fastpar",
        )
        return held, plan.__dict__ | {"total": plan.total}, ddp.comm_bytes, psi
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), stage=stage)
    model(x).sum().backward()
    opt.step()
    held = opt.memory_bytes()
    numels = [b.numel for b in opt.buckets]
    plan = estimate_memory(
        psi,
        dist.get_world_size(),
        stage,
        param_bytes=4,
        grad_bytes=4,
        optimizer_bytes=8,  # fp32 params: exp_avg + exp_avg_sq, no separate master
        mode="fastpar",
        bucket_numels=numels,
    )
    return held, plan.__dict__ | {"total": plan.total}, opt.comm_bytes, psi


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_measured_bytes_match_the_plan(stage, world):
    for held, plan, comm, psi in run_ranks(_measure, world, stage):
        assert held["params"] == plan["params"]
        assert held["grads"] == plan["grads"]
        # AdamW keeps one 0-dim fp32 "step" per tensor beyond the K bytes per element; fp32
        # parameters need no separate master (the shard of the parameter buffer is the master)
        n_tensors = 4 if stage == 0 else 1
        assert held["masters"] == 0
        assert held["optimizer"] - 4 * n_tensors == plan["optimizer"]
        # bytes sent per step: a ring all-reduce (DDP) or reduce-scatter + all-gather (ZeRO)
        # moves 2(N-1)/N of the (padded, fp32) parameter count — the "2Ψ" of the paper
        padded = -(-psi // world) * world if stage else psi
        assert comm == pytest.approx(2 * (world - 1) / world * padded * 4)


def test_the_planner_cli_shards_over_dp_over_the_replicas(capsys):
    """``python -m fastpar.zero --dp 64 --dp-replicate 8``: ZeRO's state over the 8 ranks of a
    shard group (the paper's model, Ψ = 7.5e9: 4Ψ + 12Ψ/8, 2Ψ + 14Ψ/8, 16Ψ/8 GB), not over 64;
    a replica count that does not divide dp is refused naming both."""
    from fastpar.zero.__main__ import main

    main(["--params", "7.5e9", "--dp", "64", "--dp-replicate", "8"])
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row == ["64", "120", "41.2", "28.1", "15"], row
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--dp", "6", "--dp-replicate", "4"])
    assert "--dp-replicate 4 must divide every --dp value; 6" in capsys.readouterr().err
