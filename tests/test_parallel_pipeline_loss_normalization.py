"""A loss that counts each valid target once: ``PipelineEngine(normalization="token")`` at
dp 2 x pp 2 gives the loss and every gradient of one device's mean over the whole global batch
(``F.cross_entropy`` with ignored targets, in one piece), with ignored targets spread very
unevenly — a micro-batch with none valid, one data-parallel rank with ten times the other's
valid targets — whether the count is given (``valid_tokens``) or all-reduced by the engine. The
same run under "sequence" (a mean of means) disagrees with that reference: the check can fail.
A global batch with no valid target gives loss and gradients 0, no NaN."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _pipeline import V, batch, blocks, check_step, dense_name, dense_references

from fastpar.parallel import DistributedDataParallel
from fastpar.parallel.pipeline import OneFOneB, PipelineEngine, build_stage
from fastpar.testing import run_ranks

ROWS = 16  # the global batch: rank 0 holds rows 0-7 (micro-batches 0-3, 4-7), rank 1 rows 8-15


def uneven(step: int):
    """The global batch with targets ignored unevenly: rows 0-3 (dp rank 0's first
    micro-batch) none valid, rows 4-7 one valid target each (4 in all), rows 8-15 all 5 valid
    (40: ten times rank 0's)."""
    x, y = batch(step, ROWS)
    y = y.clone()
    y[:4] = -100
    y[4:8, 1:] = -100
    return x, y


def mild(step: int):
    """Uneven but no empty micro-batch: rows 0-7 two valid targets each, rows 8-15 all."""
    x, y = batch(step, ROWS)
    y = y.clone()
    y[:8, 2:] = -100
    return x, y


def token_mean(logits, y):  # one device: the mean over every valid target of the batch
    return F.cross_entropy(logits, y.flatten(), ignore_index=-100)


def token_sum(logits, y):
    return F.cross_entropy(logits, y.flatten(), ignore_index=-100, reduction="sum")


@functools.cache
def refs_of(data_name: str):
    data = {"uneven": uneven, "mild": mild}[data_name]
    return dense_references(lambda: blocks(4), 2, ROWS, data=data, loss=token_mean)


def _run(normalization: str, given: bool, data_name: str, refs, expect_agree: bool = True):
    data = {"uneven": uneven, "mild": mild}[data_name]
    mesh = make_mesh(pp=2, dp=2)
    stage, (lo, _) = build_stage(blocks(4), 2, mesh.pp_rank, costs=[1] * 6)
    ddp = DistributedDataParallel(stage, mesh=mesh)
    loss_fn = token_sum if normalization == "token" else token_mean
    engine = PipelineEngine(
        ddp, mesh, OneFOneB(2), loss_fn=loss_fn, no_sync=ddp.no_sync, normalization=normalization
    )
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    half = slice(mesh.dp_rank * 8, mesh.dp_rank * 8 + 8)
    agreed = []
    for step in range(2):
        x, y = data(step)
        count = int((y != -100).sum()) if given else None
        opt.zero_grad()
        loss = engine.train_step(x[half], y[half], valid_tokens=count)
        dist.all_reduce(loss, group=mesh.dp_group)
        grads = [(dense_name(n, lo), p.grad) for n, p in stage.named_parameters()]
        where = f"rank {mesh.rank} step {step + 1}: "
        if expect_agree:
            check_step(refs, step, loss / 2, grads, where)
        else:
            ok = refs.loss(step, loss / 2).ok and all(refs.grad(step, n, g).ok for n, g in grads)
            agreed.append(ok)
        opt.step()
    return agreed


@pytest.mark.parametrize("given", [True, False], ids=["count-given", "count-all-reduced"])
def test_token_normalization_equals_one_device_on_the_whole_batch(given):
    run_ranks(_run, 4, "token", given, "uneven", refs_of("uneven"))


def test_sequence_normalization_is_a_mean_of_means_and_disagrees():
    agreed = run_ranks(_run, 4, "sequence", True, "mild", refs_of("mild"), False)
    # the last stage's ranks hold the loss and the head: a mean of means moves both
    assert not any(agreed[1]) and not any(agreed[3]), agreed


def _empty() -> None:
    mesh = make_mesh(pp=2)
    stage, _ = build_stage(blocks(4), 2, mesh.pp_rank, costs=[1] * 6)
    ddp = DistributedDataParallel(stage, mesh=mesh)
    engine = PipelineEngine(
        ddp, mesh, OneFOneB(2), loss_fn=token_sum, no_sync=ddp.no_sync, normalization="token"
    )
    x, y = batch(0, 8)
    loss = engine.train_step(x, torch.full_like(y, -100))
    assert float(loss) == 0.0
    for n, p in stage.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, n


def test_a_batch_with_no_valid_target_is_zero_not_nan():
    run_ranks(_empty, 4)


def test_normalization_is_checked():
    mesh = None
    with pytest.raises(ValueError, match="'sequence' or 'token'"):
        PipelineEngine(torch.nn.Linear(2, V), mesh, OneFOneB(1), normalization="tokens")
