"""The activation-memory estimate of every pipeline schedule against what the ranks really keep:
``fastpar.train.memory.stage_bytes`` (the model's bytes a token per block, held as the schedule
holds its micro-batches) within 10 % of each rank's measured peak in a real trainer step on
gloo ranks — GPipe, 1F1B, interleaved (2 chunks a rank) and ZB-H1 (each micro-batch kept
until its W), GPT and grouped-query Llama, and at TP 2 and TP 2 x sequence parallel (each TP
rank against its stage's estimate); with multi-token prediction (the MTP modules on the last
stage: a Llama, the fused cross-entropy's gradient per depth, a DeepSeek with a MoE MTP block),
under ZB-H1 too, and ZB-H1 with full recompute (its B's recomputed graph lives until the W).

Measured: the storages autograd saves for backward (``saved_tensors_hooks``) and, under a split
backward, the output gradients each B stores for its W (``SplitBackward.grad_in``, until the W
ends), each counted once while any of them still refers to it, the parameters' storages left
out; the peak over the step of the sum, per rank."""

from __future__ import annotations

import pytest
import torch
from _flags import ONE_RANK, tiny_config

from fastpar import ParallelMesh
from fastpar.parallel.pipeline import (
    SCHEDULES,
    GPipe,
    Interleaved,
    OneFOneB,
    ZeroBubbleH1,
    make_schedule,
)
from fastpar.parallel.pipeline.zb import SplitBackward
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, memory
from fastpar.train.build import Trainer

#: (TINY's heads, batch and quiet)
BASE = tiny_config(ONE_RANK, pp=2, layers=6, hidden=64, seq_len=64, microbatches=4, steps=1)


class SavedBytes:
    """The live bytes of the storages autograd holds for backward, and their peak: a storage
    counts from the first tensor saved on it until the last one is released."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def hold(self, t: torch.Tensor) -> tuple[int, int] | None:
        """Count ``t``'s storage (a parameter's: not) until ``release(*held)``."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params:
            return None
        if not self.refs.get(ptr):
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return ptr, storage.nbytes()

    def pack(self, t: torch.Tensor):
        held = self.hold(t)
        if held is None:
            return t
        # held detached: a node's own output held with its grad_fn would make a cycle through
        # the graph that nothing collects (autograd holds saved outputs without it)
        return _Saved(self, t.detach(), *held)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Saved) else held

    def release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.live -= nbytes


class _Saved:
    """One saved tensor; autograd dropping it (its graph freed) releases its storage's count."""

    def __init__(self, counter: SavedBytes, tensor: torch.Tensor, ptr: int, nbytes: int):
        self.counter, self.tensor, self.ptr, self.nbytes = counter, tensor, ptr, nbytes

    def __del__(self) -> None:
        self.counter.release(self.ptr, self.nbytes)


def _peak(cfg: TrainConfig) -> int:
    """This rank's peak of saved bytes in one training step of ``cfg``; under a split
    backward with the output gradients each B stores for its W (``SplitBackward.grad_in``)."""
    trainer = Trainer(cfg, ParallelMesh(cfg.tp, cfg.pp, cfg.ep), torch.device("cpu"))
    counter = SavedBytes(trainer.stage_module.parameters())
    stored: dict[int, list] = {}
    b_pass, w_pass = SplitBackward.input_grads, SplitBackward.weights

    def input_grads(split):
        got = b_pass(split)
        grads = [g for gs in split.grad_in.values() for g in gs if g is not None]
        stored[id(split)] = [counter.hold(g) for g in grads]
        return got

    def weights(split, prompt=False):
        w_pass(split, prompt)
        for held in stored.pop(id(split)):
            if held is not None:
                counter.release(*held)

    SplitBackward.input_grads, SplitBackward.weights = input_grads, weights
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            trainer.step()
    finally:  # a pool's rank serves later calls
        SplitBackward.input_grads, SplitBackward.weights = b_pass, w_pass
    assert counter.live == 0 and not stored, counter.live  # every graph freed by the step's end
    return counter.peak


@pytest.mark.parametrize(
    "layout",
    [
        dict(schedule="gpipe"),
        dict(schedule="1f1b"),
        dict(schedule="interleaved", virtual_stages=2),
        dict(schedule="zb-h1"),
        dict(schedule="1f1b", model_type="llama", kv_heads=2),
        dict(schedule="zb-h1", model_type="llama", pp=4, microbatches=8, batch_size=16),
        dict(schedule="1f1b", tp=2),
        pytest.param(
            dict(schedule="1f1b", tp=2, sequence_parallel=True, model_type="llama", kv_heads=2),
            marks=pytest.mark.slow,
        ),
        dict(schedule="1f1b", model_type="llama", kv_heads=2, mtp_depth=1),
        # each MTP module's fused cross-entropy keeps its own head-weight gradient
        dict(schedule="1f1b", model_type="llama", mtp_depth=2, fused_ce=True, vocab_size=2048),
        dict(schedule="1f1b", model_type="deepseek", moe_every=1, experts=4, mtp_depth=1),
        # ZB-H1's B stores the output gradients W reads: the MTP modules' too
        dict(schedule="zb-h1", model_type="llama", kv_heads=2, mtp_depth=1),
        dict(schedule="zb-h1", model_type="deepseek", moe_every=1, experts=4, mtp_depth=1),
        dict(schedule="zb-h1", recompute=True),
    ],
    ids=[
        "gpipe",
        "1f1b",
        "interleaved",
        "zb-h1",
        "llama-gqa-1f1b",
        "llama-zb-h1-pp4",
        "tp2-1f1b",
        "llama-tp2-sp-1f1b",
        "llama-mtp1-1f1b",
        "llama-mtp2-fused-ce-1f1b",
        "deepseek-mtp1-1f1b",
        "llama-mtp1-zb-h1",
        "deepseek-mtp1-zb-h1",
        "zb-h1-full-recompute",
    ],
)
def test_estimate_matches_the_saved_activations(layout):
    cfg = TrainConfig.from_flags(**{**BASE, **layout})
    cfg.check()
    measured = run_ranks(_peak, cfg.tp * cfg.pp, cfg)
    estimated = memory.stage_bytes(cfg)
    for rank, got in enumerate(measured):
        est = estimated[rank // cfg.tp]  # TP is the fastest-varying rank (Megatron's order)
        assert abs(est - got) <= 0.1 * got, (rank, est, got, measured, estimated)
    assert memory.activation_bytes(cfg)[0] == max(estimated)


def test_schedules_differ_as_measured():
    """The estimates follow the schedules, not one formula: GPipe keeps every micro-batch on
    every rank, 1F1B pp - rank on rank r, ZB-H1 on its last rank more than 1F1B (a forward
    runs before the previous micro-batch's W)."""
    est = {
        s: memory.stage_bytes(TrainConfig.from_flags(**{**BASE, "schedule": s}))
        for s in ("gpipe", "1f1b", "zb-h1")
    }
    assert est["gpipe"][0] > est["1f1b"][0] and est["gpipe"][1] > est["1f1b"][1]
    assert est["zb-h1"][1] > est["1f1b"][1]


def test_held_weighs_each_chunk():
    """Interleaved, 2 ranks, 4 micro-batches, 2 chunks: rank 0 runs F0.0 F1.0 F0.1 F1.1 F2.0,
    then B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 ...: at most 3 chunk-0 and 2 chunk-1 forwards in flight
    at once (after F2.0 and again after F3.1), so chunks weighing 1 and 10 peak at 23."""
    sched = Interleaved(4, 2)
    assert sched.held(2, 0, [1, 10]) == 23
    assert sched.held(2, 0) == sched.max_in_flight(2, 0) == 5
    with pytest.raises(ValueError, match="1 sizes, 2 stored for 2 chunks"):
        sched.held(2, 0, [1])


def test_held_adds_what_a_split_backward_stores_until_w():
    """ZB-H1 on its last rank of 2 (F0 B0 F1 B1 W0 F2 B2 W1 ...): 1 a forward, 10 more from its
    B until its W, so two micro-batches past B: 22. Without a split backward nothing is
    stored."""
    assert ZeroBubbleH1(4).held(2, 1, [1], [10]) == 22
    assert ZeroBubbleH1(4).held(2, 1, [1]) == ZeroBubbleH1(4).max_in_flight(2, 1) == 2
    assert OneFOneB(4).held(2, 1, [1], [10]) == 1


def test_the_registry_declares_what_each_schedule_takes():
    assert {name: cls.name for name, cls in SCHEDULES.items()} == {n: n for n in SCHEDULES}
    assert [n for n, cls in SCHEDULES.items() if cls.chunked] == ["interleaved"]
    assert [n for n, cls in SCHEDULES.items() if cls.forwards_first] == ["gpipe"]
    assert not ZeroBubbleH1.accepts("zero3") and not Interleaved.accepts("zero3")
    assert OneFOneB.accepts("zero3") and GPipe.accepts("sequence_parallel_tp")
    assert all(cls.accepts("sequence_parallel_tp") for cls in SCHEDULES.values())
    with pytest.raises(ValueError, match="feature must be one of"):
        OneFOneB.accepts("zero-3")
    assert make_schedule("interleaved", 4, 2, 2) == Interleaved(4, 2, 2)
    with pytest.raises(ValueError, match="virtual_stages 2 needs the interleaved schedule"):
        make_schedule("zb-h1", 4, 2)
