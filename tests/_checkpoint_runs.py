"""The checkpoint-directory tests' training run, defined once: ``SMALL`` (the ``TrainConfig``
keywords: the tiny model on one rank, 4 steps saved every 2), ``run(**changes)`` (a run of it
through ``fastpar.train.launch``, its records), ``losses`` and ``steps`` of those records."""

from __future__ import annotations

from _flags import ONE_RANK, tiny_config

from fastpar.train import TrainConfig, launch

#: one rank, no MoE; one micro-batch and a clipping threshold never reached, so that pp=1, 2 and
#: 4 compute the same sums in the same order (two micro-batches or an active clip would sum the
#: tied embedding's gradient or the global norm in another order: equal to ~1e-7 only)
SMALL = tiny_config(
    ONE_RANK, steps=4, save_every=2, batch_size=4, zero=0, microbatches=1, max_grad_norm=1e9
)


def run(**changes) -> list[dict]:
    """The records of a run of ``SMALL`` with ``changes`` (a value None: the field's default)."""
    return launch(TrainConfig.from_flags(**tiny_config(SMALL, **changes)))


def losses(records) -> list[float]:
    return [r["loss"] for r in records]


def steps(records) -> list[int]:
    return [r["step"] for r in records]
