"""ZeRO-3 (``fastpar.zero.Zero3``) equals single-process training on the concatenated batch;
fp16 overflow agreement, bf16, TP x DP, communication and memory accounting, its arguments (its
checkpoint state: tests/test_zero_zero3_checkpoint.py).

"Equals" is ``fastpar.tolerance``'s rule (docs/tolerances.md; ``references`` / ``check`` of
tests/_training.py): sharded gradients are reduce-scattered sums of per-replica means, not the
single process's sums, so each step's loss, gradient norm and every parameter afterwards are
judged against the same training in float64, beside the fp32 single-process run and its twin."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _training import (
    check,
    check_overflow_skipped,
    check_training,
    mse_loss,
    references,
    sliced,
    tp_dp_steps,
    tp_references,
)
from _zero3 import D_H, D_IN, D_OUT, STEPS, Block, Net, batch, full_params, make_opt
from torch import nn

from fastpar.amp import DynamicLossScaler
from fastpar.nn import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.marks import mark_expert
from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
from fastpar.testing import run_ranks
from fastpar.zero import Zero3, ZeroOptimizer, estimate_memory


def _groups(net: nn.Module) -> list[dict]:
    """Two param groups: matrices with weight decay, vectors without (and a smaller lr)."""
    mats = [p for p in net.parameters() if p.dim() > 1]
    vecs = [p for p in net.parameters() if p.dim() <= 1]
    return [{"params": mats}, {"params": vecs, "weight_decay": 0.0, "lr": 0.02}]


def _reference(
    steps: int, micro: int, world: int, opt_name: str, clip: float | None = None, groups=False
):
    """The single-process training three ways (fp32, its twin, float64): ``References``. With
    ``groups`` AdamW's slack takes the larger learning rate (0.02) for every parameter."""

    def reference_opt(model: nn.Module) -> torch.optim.Optimizer:
        return make_opt(opt_name, _groups(model) if groups else model.parameters(), reference=True)

    return references(
        Net,
        mse_loss(micro, world, D_IN, D_OUT),
        steps,
        reference_opt,
        clip=clip,
        length=max(micro * world * 3 * D_OUT, D_H),
        lr=0.02 if groups else 0.01,
    )


def _train(micro: int, opt_name: str, policy: dict, clip: float | None) -> tuple[list, dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0 if rank == 0 else rank)  # wrapping broadcasts rank 0's parameters
    net = Net()
    policy = dict(policy)
    if policy.pop("groups", False):
        policy["param_groups"] = _groups(net)
    if policy.pop("expert", False):  # without a mesh the expert-DP group is the DP group
        for p in net.blocks[1].parameters():
            mark_expert(p)
    model = Zero3(
        net,
        lambda params: make_opt(opt_name, params),
        max_grad_norm=clip,
        **policy,
    )
    losses = []
    for step in range(STEPS):
        x, y = batch(step, micro, world)
        total = torch.zeros(())
        for m in range(micro):  # gradient accumulation: each backward reduce-scatters
            loss = F.mse_loss(model(x[m, rank]), y[m, rank]) / micro
            loss.backward()
            total += loss.detach()
        model.step()
        model.zero_grad()
        dist.all_reduce(total)
        losses.append((total / world).item())
        if step == 1:  # an inference forward between steps gathers and frees everything
            with torch.no_grad():
                model(x[0, rank])
            assert model._gathered_bytes == 0
    assert all(p.numel() == 0 for f in model._flats if f.sharded for p in f.bucket.params)
    with model.summon_full_params():
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return losses, params


CASES = [
    # world, micro, optimizer, wrap policy, clip
    (2, 1, "sgd", {"wrap": (Block,)}, None),
    (4, 1, "adamw", {"wrap": (Block,)}, 0.5),
    (2, 2, "adamw", {"min_params": 100}, None),  # min_params: the Linear layers become units
    (4, 2, "sgd", {"wrap": (Block,), "persist_below": 20}, None),  # biases/norms replicated
    (4, 1, "adamw", {"wrap": (Block,), "persist_below": 20, "prefetch": False}, 0.5),
    (2, 1, "adamw", {"wrap": (Block,), "groups": True, "expert": True}, 0.5),
]


@pytest.mark.parametrize("world,micro,opt_name,policy,clip", CASES)
def test_training_equals_single_process(world, micro, opt_name, policy, clip):
    refs = _reference(STEPS, micro, world, opt_name, clip, groups=policy.get("groups", False))
    check_training(refs, run_ranks(_train, world, micro, opt_name, policy, clip))


def _fp16_overflow(opt_name: str) -> tuple:
    """fp16 + dynamic loss scaling + an inf injected on one rank: everyone skips that step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Zero3(
        Net().half(),
        lambda params: make_opt(opt_name, params),
        wrap=(Block,),
        persist_below=20,
        scaler=DynamicLossScaler(initial_scale=1024.0, hysteresis=1),
    )
    skips, unchanged = [], []
    for step in range(4):
        x, y = batch(step, 1, world)
        before = full_params(model)
        loss = F.mse_loss(model(x[0, rank].half()).float(), y[0, rank])
        model.scale_loss(loss).backward()
        if step == 1 and rank == world - 1:  # corrupt this rank's shard after the reduction
            model.shard_grads[-1].view(-1)[0] = float("inf")
        skipped, _ = model.step()
        model.zero_grad()
        after = full_params(model)
        skips.append(bool(skipped))
        unchanged.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        assert all(torch.isfinite(p).all() for p in after)
        assert all(p.dtype == torch.float16 for p in after)
    return skips, unchanged, float(model.scaler.scale)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])  # skipped on the device / by a host sync
def test_fp16_overflow_on_one_rank_skips_everywhere(opt_name):
    check_overflow_skipped(run_ranks(_fp16_overflow, 2, opt_name))


def _bf16() -> tuple[list[float], dict, dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Zero3(Net().to(torch.bfloat16), lambda ps: make_opt("adamw", ps), wrap=(Block,))
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 1, world)
        loss = F.mse_loss(model(x[0, rank].bfloat16()).float(), y[0, rank])
        loss.backward()
        model.step()
        model.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
    assert all(f.master.dtype == torch.float32 for f in model._flats)
    assert all(f.shard.dtype == torch.bfloat16 for f in model._flats)
    with model.summon_full_params():
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return losses, params, model.memory_bytes()


def _bf16_loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = batch(step, 1, 2)
    out = model(x.reshape(-1, D_IN).to(dtype))
    acc = torch.promote_types(dtype, torch.float32)  # the loss in fp32 (float64 for float64)
    return F.mse_loss(out.to(acc), y.reshape(-1, D_OUT).to(acc))


def _bf16_opt(model: nn.Module) -> torch.optim.Optimizer:
    """What Zero3 runs in bf16 on one process: AdamW on fp32 masters (float64: AdamW as is)."""
    if next(model.parameters()).dtype == torch.float64:
        return make_opt("adamw", model.parameters(), reference=True)
    return MixedPrecisionOptimizer(make_opt("adamw", model.parameters()))


def test_bf16_trains_like_the_single_process():
    """bf16 parameters with fp32 masters: each step's loss and every parameter after the steps
    against the single-process bf16 run (fp32 masters too) and its twin, judged in bf16's
    precision against the float64 run."""
    refs = references(
        Net, _bf16_loss, STEPS, _bf16_opt, length=2 * 3 * D_OUT, lr=0.01, dtype=torch.bfloat16
    )
    for losses, params, mem in run_ranks(_bf16, 2):
        check([refs.loss(step, v) for step, v in enumerate(losses)])
        check([refs.param(name, p) for name, p in params.items()])
        assert mem["masters"] == 2 * mem["params"]  # fp32 masters beside bf16 shards


def _tp_dense() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 18),
        nn.GELU(),
        nn.Linear(18, 8),
        nn.GELU(),
        nn.Linear(8, 10),
        nn.GELU(),
        nn.Linear(10, 8),
    )


def _tp_dp(fused: bool, persist_below: int, refs) -> None:
    """TP = 2 inside, DP = 2 across: ZeRO-3 over DP shards the TP-local tensors again. Every
    step's loss (averaged over the replicas) and gradient norm, every TP-local parameter after
    the steps, against the dense model on the whole batch (``tp_references``)."""
    mesh = make_mesh(tp=2, dp=2)
    torch.manual_seed(0)
    dense = _tp_dense()
    par = nn.Sequential(
        *[
            ColumnParallelLinear.from_dense(m, mesh=mesh)
            if i % 4 == 0
            else RowParallelLinear.from_dense(m, mesh=mesh)
            if i % 4 == 2
            else m
            for i, m in enumerate(dense)
        ]
    )
    inner = FusedAdamW if fused else torch.optim.AdamW
    model = Zero3(
        par,
        lambda ps: inner(ps, lr=1e-2),
        mesh=mesh,
        wrap=(ColumnParallelLinear, RowParallelLinear),
        persist_below=persist_below,
        max_grad_norm=0.5,
    )
    tp_dp_steps(model, model, mesh, refs, STEPS)
    with model.summon_full_params():
        named = dict(par.named_parameters())
        sliced(refs, named)
        check([refs.param(n, p.detach()) for n, p in named.items()], f"after {STEPS} steps: ")


@pytest.mark.parametrize("fused,persist_below", [(False, 0), (True, 0), (True, 10)])
def test_tp2_dp2_equals_dense(fused, persist_below):
    """persist_below=10 keeps the biases replicated (row biases are TP-duplicated too)."""
    run_ranks(_tp_dp, 4, fused, persist_below, tp_references(_tp_dense, STEPS))


def _comm_and_memory(persist_below: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Zero3(
        Net(),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        wrap=(Block,),
        persist_below=persist_below,
    )
    sent = []
    for step in range(2):
        before = dict(model.comm_bytes_by)
        x, y = batch(step, 1, world)
        F.mse_loss(model(x[0, rank]), y[0, rank]).backward()
        model.step()
        model.zero_grad()
        sent.append({k: model.comm_bytes_by[k] - before[k] for k in before})
    torch.manual_seed(0)
    net2 = Net()
    z2 = ZeroOptimizer(torch.optim.AdamW(net2.parameters(), lr=1e-3), stage=2)
    x, y = batch(0, 1, world)
    F.mse_loss(net2(x[0, rank]), y[0, rank]).backward()
    z2.step()
    z2.zero_grad()
    return {
        "sent": sent,
        "padded": model.padded_numel(),
        "padded_persistent": model.padded_numel(sharded=False),
        "numels": model.flat_numels(),
        "n_flats": len(model._flats),
        "mem": model.memory_bytes(),
        "mem_z2": z2.memory_bytes(),
        "peak": model.peak_gathered_bytes,
        "unit_bytes": [sum(f.full_bytes for f in u.flats if f.sharded) for u in model.units],
    }


@pytest.mark.parametrize("world,persist_below", [(2, 0), (4, 0), (4, 20)])
def test_comm_bytes_and_memory(world, persist_below):
    psi = sum(p.numel() for p in Net().parameters())
    for r in run_ranks(_comm_and_memory, world, persist_below):
        padded, n = r["padded"], world
        for sent in r["sent"]:  # forward all-gather, backward all-gather, reduce-scatter (fp32)
            for kind in ("all_gather_forward", "all_gather_backward", "reduce_scatter"):
                assert sent[kind] == pytest.approx(padded * (n - 1) / n * 4)
            total = (
                sent["all_gather_forward"] + sent["all_gather_backward"] + sent["reduce_scatter"]
            )
            assert total == pytest.approx(3 * padded * (n - 1) / n * 4)
            # persistent parameters: a ring all-reduce of their (unpadded) fp32 gradients
            assert sent["all_reduce"] == pytest.approx(2 * (n - 1) / n * r["padded_persistent"] * 4)
        if persist_below == 0:
            assert r["padded_persistent"] == 0
            assert padded - psi < n * r["n_flats"]  # padding only
        mem, z2 = r["mem"], r["mem_z2"]
        assert mem["params"] == padded // n * 4 + r["padded_persistent"] * 4
        assert mem["total"] < z2["total"]
        if persist_below == 0:
            assert mem["params"] * n == z2["params"]  # params 1/N of ZeRO-2's (same padding)
            plan = estimate_memory(
                psi,
                n,
                3,
                param_bytes=4,
                grad_bytes=4,
                optimizer_bytes=8,
                mode="fastpar",
                bucket_numels=r["numels"],
            )
            assert mem["params"] == plan.params
            assert mem["grads"] == plan.grads
            assert mem["optimizer"] - 4 * r["n_flats"] == plan.optimizer  # + one "step" each
        # the root stays gathered; at most the running unit and the prefetched one beside it
        root, *units = r["unit_bytes"]
        assert max(units) <= r["peak"] <= root + 2 * max(units)


def test_bad_arguments():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match=r"either wrap= .* or min_params="):
        Zero3(Net(), sgd, wrap=(Block,), min_params=10)
    with pytest.raises(ValueError, match="in no entry of param_groups"):
        net = Net()
        Zero3(net, sgd, param_groups=[{"params": list(net.head.parameters())}])
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        Zero3(Net(), sgd, max_grad_norm=0.0)


def test_single_process_without_process_group():
    """World of one (no process group): a plain optimizer on the whole model — on flat buffers,
    so judged by the rule against plain SGD in fp32 (its twin) and float64, not for equality."""
    torch.manual_seed(0)
    model = Zero3(Net(), lambda ps: torch.optim.SGD(ps, lr=0.1), min_params=100)
    for step in range(2):
        x, y = batch(step, 1, 1)
        F.mse_loss(model(x[0, 0]), y[0, 0]).backward()
        model.step()
        model.zero_grad()
    refs = references(
        Net,
        mse_loss(1, 1, D_IN, D_OUT),
        2,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        length=3 * D_OUT,
    )
    with model.summon_full_params():
        check([refs.param(n, p.detach()) for n, p in model.module.named_parameters()])
