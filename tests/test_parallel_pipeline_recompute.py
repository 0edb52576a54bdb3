"""Pipeline recomputation restores the RNG state of the device the stage runs on: dropout
masks of the recomputed forward equal the first forward's, on a CPU stage (CPU tier) and on a
GPU stage (GPU tier: CUDA dropout draws from the GPU's generator, never the CPU's)."""

from __future__ import annotations

import pytest
import torch
from _mesh import make_mesh
from _pipeline import batch, blocks, loss_fn
from torch import nn

from fastpar.parallel.pipeline import GPipe, PipelineEngine
from fastpar.testing import run_ranks


def _recompute_dropout_on(device: str) -> None:
    """One stage on ``device`` (world 1): the recomputed forward draws the dropout masks its
    first forward drew, from the generator of the device the stage runs on (the CPU's, or the
    GPU's: CUDA dropout never reads the CPU generator), so the gradients equal the run that kept
    its graph; under another seed they differ (the masks are live)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = make_mesh(pp=1)
    x, y = (t.to(device) for t in batch(0, 8))

    def grads(recompute: bool, seed: int) -> list[torch.Tensor]:
        stage = nn.Sequential(*blocks(4, dropout=0.3)).to(device)
        engine = PipelineEngine(stage, mesh, GPipe(4), loss_fn=loss_fn, recompute=recompute)
        torch.manual_seed(seed)  # the CPU's generator and every GPU's
        engine.train_step(x, y)
        return [p.grad.clone() for p in stage.parameters()]

    kept, recomputed, other = grads(False, 123), grads(True, 123), grads(True, 7)
    for a, b in zip(kept, recomputed, strict=True):  # the same kernels, the same masks: bits
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(kept, other, strict=True))


def test_recompute_replays_dropout_on_one_cpu_stage():
    run_ranks(_recompute_dropout_on, 1, "cpu")


@pytest.mark.cuda
def test_recompute_replays_dropout_on_the_gpu():
    run_ranks(_recompute_dropout_on, 1, "cuda", backend="nccl", start_method="spawn")
