"""The trainer under test, a step at a time: each rank's gradients after the first forward and
backward of ``fastpar.train.Trainer`` judged against its piece of the single-process model's
(``first_step_gradients``; ``every_gradient_agrees``: on every rank of a run), and a text of
short documents and empty ones to train on (``write_documents``) with the run of one step on
it that the gradient tests share (``FIRST_STEP``)."""

from __future__ import annotations

import torch

from fastpar.train import TrainConfig

#: the gradient tests' run (``tiny_config(FIRST_STEP, ...)``): one step of 4 sequences in 2
#: micro-batches, documents ended by the newline (id 10), no data parallelism or ZeRO
FIRST_STEP = dict(steps=1, batch_size=4, microbatches=2, eos_id=10, dp=1, ep=1, zero=0)


def write_documents(path) -> str:
    """Text with documents of 3 to 21 tokens and empty ones (targets ignored) at ``path``."""
    words = "the quick brown fox jumps over a lazy dog "
    path.write_text("".join(words[: 2 + 3 * (i % 7)] + "\n" * (1 + i % 3) for i in range(200)))
    return str(path)


def first_backward(cfg: TrainConfig, corpus=None):
    """On this rank: the trainer of ``cfg`` and its first step's forward and backward through
    the engine (no optimizer step); returns (trainer, mesh)."""
    from _mesh import make_mesh

    from fastpar.train import Trainer

    mesh = make_mesh(cfg.tp, cfg.pp, cfg.ep, cp=cfg.cp)
    trainer = Trainer(cfg, mesh, torch.device("cpu"), corpus)
    x, y = trainer._batch(0)
    trainer.engine.train_step(
        x if mesh.is_first_stage else None,
        y if mesh.is_last_stage else None,
        broadcast_loss=False,
        valid_tokens=trainer._count(),
        context=trainer.context,
    )
    return trainer, mesh


def first_step_gradients(cfg: TrainConfig, refs, corpus=None) -> list[str]:
    """On this rank: the first step's forward and backward through the trainer's engine (no
    optimizer step), each parameter's gradient judged against this rank's piece of the
    single-process model's (``fastpar.tolerance``'s rule; the float64 run as the truth).
    Returns ``["N gradients checked, M of MTP modules", *each disagreement]``."""
    from fastpar.checkpoint.state import checkpoint_name, localize

    trainer, _ = first_backward(cfg, corpus)
    params = {checkpoint_name(n, p): p for n, p in trainer.named_parameters().items()}
    refs.local = lambda full, name: localize(full, params[name])
    mtp = sum(".mtp." in n for n in params)
    bad = [str(c) for n, p in params.items() if not (c := refs.grad(0, n, p.grad.double())).ok]
    return [f"{len(params)} gradients checked, {mtp} of MTP modules", *bad]


def every_gradient_agrees(cfg: TrainConfig, corpus=None) -> list[list[str]]:
    """``cfg`` checked, then ``first_step_gradients`` on each of its ranks against
    ``fastpar.verify``'s references (of ``corpus``): every rank checked some gradient and none
    disagreed. Returns each rank's lines (for what a test asserts beyond that)."""
    from fastpar.testing import run_ranks
    from fastpar.verify import references

    cfg.check()
    refs = references(cfg, corpus)
    results = run_ranks(first_step_gradients, cfg.world_size, cfg, refs, corpus)
    for rank, lines in enumerate(results):
        assert int(lines[0].split()[0]) > 0, lines
        assert len(lines) == 1, f"rank {rank}: " + "\n".join(lines)
    return results
