"""--compile (each block's forward under torch.compile, CPU inductor) trains like eager: the
loss and gradient norm of every step agree with the single-process model by fastpar.tolerance's
rule (inductor fuses and reorders, so not bit for bit), eager's too, and the parameter names
(and so checkpoints) are unchanged. The dense default model (tensor parallel, so its collectives
run inside compiled blocks) and, separately, a MoE model (dropless routing, expert parallel).
Inductor's C++ code does not build under ATEN_CPU_CAPABILITY=default (torch 2.13: "at::vec
has not been declared"), so these skip there."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _flags import ONE_RANK, tiny_config
from _parity import NO_INDUCTOR

from fastpar import tolerance
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, Trainer
from fastpar.train.compile import compile_blocks
from fastpar.train.loop import run
from fastpar.verify import references

pytestmark = [NO_INDUCTOR, pytest.mark.slow]  # inductor: about 25 s a test on 2 cores

#: 3 steps of 4 sequences at a constant rate
CONSTANT = dict(steps=3, batch_size=4, warmup=0, lr_schedule="constant", quiet=True)
#: the default model's width, heads and sequence (64, 4, 64); two blocks
DENSE = dict(ONE_RANK, tp=2, layers=2, **CONSTANT)
MOE = tiny_config(ONE_RANK, CONSTANT, dp=2, ep=2, moe_every=2, experts=4, top_k=2, heads=2)


def _both(cfg: TrainConfig) -> tuple[list[dict], list[dict], bool]:
    """(eager records, compiled records, whether the compiled blocks kept their names)."""
    import torch.distributed as dist
    from _mesh import make_mesh

    eager = run(cfg)
    compiled = run(dataclasses.replace(cfg, compile=True))
    mesh = make_mesh(cfg.tp, cfg.pp, cfg.ep)
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    names = list(trainer.named_parameters())
    assert compile_blocks(trainer.stage_module)  # every block, once
    assert not compile_blocks(trainer.stage_module)
    same = names == list(trainer.named_parameters())
    dist.barrier()
    return eager, compiled, same


def _check(cfg: TrainConfig) -> None:
    refs = references(cfg, None)  # one process: fp32, its twin, float64
    ones = (refs.single, refs.twin)
    for eager, compiled, same_names in run_ranks(_both, cfg.world_size, cfg, timeout=600):
        assert same_names
        assert [r["step"] for r in compiled] == [1, 2, 3]
        for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
            for what, r in (("eager", a), ("compiled", b)):
                c = refs.loss(i, r["loss"])
                assert c.ok, f"{what}: {c}"
                c = tolerance.compare(
                    r["grad_norm"],
                    [o.norms[i] for o in ones],
                    refs.exact.norms[i],
                    length=refs.length,
                    what=f"{what}: grad norm of step {i + 1}",
                )
                assert c.ok, c
        assert compiled[-1]["loss"] < compiled[0]["loss"]  # it trains


def test_compile_dense_default_model_equals_eager():
    _check(TrainConfig.from_flags(**DENSE))


def test_compile_packed_documents_equals_eager():
    """Packed documents (each line of the embedded corpus, newline-ended, one document): the
    document attention runs eagerly between compiled pieces (one graph break a layer)."""
    cfg = TrainConfig.from_flags(**DENSE, eos_id=10)
    assert cfg.packs_documents
    _check(cfg)


def test_compile_moe_dropless_equals_eager():
    _check(TrainConfig.from_flags(**MOE))
