"""--compile (each block's forward under torch.compile, CPU inductor) trains like eager: the
loss and gradient norm of every step within fp32 reordering noise, the parameter names (and so
checkpoints) unchanged. The dense default model (tensor parallel, so its collectives run inside
compiled blocks) and, separately, a MoE model (dropless routing, expert parallel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, Trainer
from fastpar.train.compile import compile_blocks
from fastpar.train.loop import run

#: the default model's width, heads and sequence (64, 4, 64); two blocks; a constant rate
DENSE = dict(tp=2, pp=1, dp=1, ep=1, moe_every=0, layers=2, steps=3, batch_size=4, warmup=0,
             lr_schedule="constant", quiet=True)  # fmt: skip
MOE = dict(tp=1, pp=1, dp=2, ep=2, moe_every=2, experts=4, top_k=2, layers=2, hidden=32, heads=2,
           seq_len=16, steps=3, batch_size=4, warmup=0, lr_schedule="constant",
           quiet=True)  # fmt: skip


def _both(cfg: TrainConfig) -> tuple[list[dict], list[dict], bool]:
    """(eager records, compiled records, whether the compiled blocks kept their names)."""
    import torch.distributed as dist

    from fastpar.mesh import ParallelMesh

    eager = run(cfg)
    compiled = run(dataclasses.replace(cfg, compile=True))
    mesh = ParallelMesh(cfg.tp, cfg.pp, cfg.ep)
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    names = list(trainer.named_parameters())
    assert compile_blocks(trainer.stage_module)  # every block, once
    assert not compile_blocks(trainer.stage_module)
    same = names == list(trainer.named_parameters())
    dist.barrier()
    return eager, compiled, same


def _check(cfg: TrainConfig, loss_tol: float, norm_tol: float) -> None:
    for eager, compiled, same_names in run_ranks(_both, cfg.world_size, cfg, timeout=600):
        assert same_names
        assert [r["step"] for r in compiled] == [1, 2, 3]
        for a, b in zip(eager, compiled, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=loss_tol), (a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=norm_tol), (a, b)
        assert compiled[-1]["loss"] < compiled[0]["loss"]  # it trains


def test_compile_dense_default_model_equals_eager():
    _check(TrainConfig(**DENSE), loss_tol=1e-5, norm_tol=1e-4)


@pytest.mark.slow  # inductor compiles the MoE blocks for about a minute on 2 cores
def test_compile_moe_dropless_equals_eager():
    _check(TrainConfig(**MOE), loss_tol=1e-5, norm_tol=1e-4)
