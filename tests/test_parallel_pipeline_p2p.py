"""Early receives (``P2P.post_recv``): posted only once a channel's shapes are known, taken by
``recv`` in message order (early and ordinary receives mixed on one channel), tuple slots
flagged as sent; every schedule gives bit-identical losses and gradients with and without
them, and the engine does post them (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh
from _pipeline import batch, blocks, loss_fn, tuple_blocks

from fastpar.parallel.pipeline import (
    P2P,
    PipelineEngine,
    build_stage,
    build_virtual_stages,
    make_schedule,
)
from fastpar.testing import run_ranks

CPU = torch.device("cpu")


def _channel(static: bool, early) -> list:
    """Rank 0 sends five tensors on tag 0 and three tuples on tag 1; rank 1 mixes early and
    ordinary receives. Returns rank 1's (posted?, values) log."""
    rank = dist.get_rank()
    p2p = P2P(0 if rank else None, 1 if rank == 0 else None, static_shapes=static)
    p2p.early_recvs = early
    if rank == 0:
        for k in range(5):
            p2p.send(torch.full((2, 3), float(k)), 1, tag=0)
        for k in range(3):
            w = torch.full((2,), float(k), requires_grad=True)
            p2p.send((w, None, torch.tensor([k])), 1, tag=1)
        p2p.wait_sends()
        return []
    log = [p2p.post_recv(0, CPU, tag=0)]  # nothing known about the channel yet: not posted
    log.append(p2p.recv(0, CPU, tag=0)[0, 0].item())
    log += [p2p.post_recv(0, CPU, tag=0), p2p.post_recv(0, CPU, tag=0)]
    log += [p2p.recv(0, CPU, tag=0)[0, 0].item() for _ in range(3)]  # early, early, ordinary
    log += [p2p.post_recv(0, CPU, tag=0), p2p.posted_recvs()]
    log.append(p2p.recv(0, CPU, tag=0)[1, 2].item())
    first = p2p.recv(0, CPU, tag=1)
    log.append(p2p.post_recv(0, CPU, tag=1))
    second = p2p.recv(0, CPU, tag=1)
    third = p2p.recv(0, CPU, tag=1)
    for msg in (first, second, third):
        assert msg[0].requires_grad and msg[1] is None and not msg[2].requires_grad
    log += [[msg[0][0].item(), msg[2].item()] for msg in (first, second, third)]
    log.append(p2p.posted_recvs())
    return log


@pytest.mark.parametrize("static, early", [(True, None), (True, False), (False, None)])
def test_early_receives_keep_message_order(static, early):
    log = run_ranks(_channel, 2, static, early)[1]
    posts = static and early is None  # posted only with shapes agreed, on CPU (gloo)
    assert log == [
        False,
        0.0,
        posts,
        posts,
        1.0,
        2.0,
        3.0,
        posts,
        int(posts),
        4.0,
        posts,
        [0.0, 0],
        [1.0, 1],
        [2.0, 2],
        0,
    ]


def _both(name: str, v: int, m: int, make, n: int, recompute: bool) -> int:
    """Two steps with early receives and two without, from the same weights: bit-identical
    losses and gradients. Returns how many receives this rank posted early."""
    mesh = make_mesh(pp="world")
    first, last = mesh.is_first_stage, mesh.is_last_stage
    results, posted = [], 0
    for early in (None, False):
        costs = [1] * (n + 2)
        if v > 1:
            stage, _ = build_virtual_stages(make(n), mesh.pp_size, mesh.pp_rank, v, costs=costs)
        else:
            stage, _ = build_stage(make(n), mesh.pp_size, mesh.pp_rank, costs=costs)
        sched = make_schedule(name, m, v)
        engine = PipelineEngine(stage, mesh, sched, loss_fn=loss_fn, recompute=recompute)
        engine.p2p.early_recvs = early
        post = engine.p2p.post_recv

        def counted(*args, _post=post, _early=early, **kwargs):
            nonlocal posted
            ok = _post(*args, **kwargs)
            posted += ok and _early is None
            return ok

        engine.p2p.post_recv = counted
        losses = []
        for step in range(2):
            x, y = batch(step, 4 * m)
            losses.append(engine.train_step(x if first else None, y if last else None))
        grads = [q.grad for q in stage.parameters()]
        results.append((losses, grads))
    (la, ga), (lb, gb) = results
    # bit for bit: early receives change when a buffer is posted, not what the layers compute
    # (the same micro-batches through the same kernels in the same order)
    assert all(torch.equal(a, b) for a, b in zip(la, lb, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
    return posted


@pytest.mark.parametrize(
    "p, name, v, m, make, recompute",
    [
        (2, "gpipe", 1, 4, blocks, True),
        (4, "1f1b", 1, 4, blocks, False),
        (2, "1f1b", 1, 3, tuple_blocks, False),
        (2, "interleaved", 2, 4, tuple_blocks, False),
        (4, "interleaved", 2, 4, blocks, True),
        (2, "zb-h1", 1, 4, tuple_blocks, False),
        (4, "zb-h1", 1, 8, blocks, False),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_early_receives_change_nothing(p, name, v, m, make, recompute):
    n = 4 if make is tuple_blocks else 2 * p * v
    posted = run_ranks(_both, p, name, v, m, make, n, recompute)
    assert all(k > 0 for k in posted), posted  # every rank receives something early
