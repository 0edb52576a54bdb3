"""Forward-only pipelined evaluation: ``PipelineEngine.eval_step`` returns the unpipelined
model's loss (eval mode, no grad) for every schedule, touches no gradient, restores the
modules' mode, and runs between training steps (its own channels, tuple messages too). The
pipelined loss is a mean of micro-batch means, judged by ``fastpar.tolerance``'s rule against
the unpipelined model in float64 beside its fp32 run."""

from __future__ import annotations

import copy

import pytest
import torch
from _flags import tiny_config
from _mesh import make_mesh
from _parity import agree, exact_copy
from _pipeline import T, V, batch, blocks, loss_fn, tuple_blocks
from torch import nn

from fastpar.parallel.pipeline import (
    ForwardOnly,
    PipelineEngine,
    build_stage,
    build_virtual_stages,
    make_schedule,
)
from fastpar.testing import run_ranks


def _eval(schedule: str, m: int, v: int, make=blocks, n: int = 6, size: int = 12) -> None:
    mesh = make_mesh(pp="world")
    dense = nn.Sequential(*make(n, dropout=0.5))  # dropout: eval mode must switch it off
    parts = copy.deepcopy(list(dense))
    if v > 1:
        stage, _ = build_virtual_stages(parts, mesh.pp_size, mesh.pp_rank, v, costs=[1] * (n + 2))
    else:
        stage, _ = build_stage(parts, mesh.pp_size, mesh.pp_rank, costs=[1] * (n + 2))
    engine = PipelineEngine(stage, mesh, make_schedule(schedule, m, v), loss_fn=loss_fn)
    dense.eval()
    dense64 = exact_copy(dense)  # the exact math of the unpipelined model
    for step in range(2):
        x, y = batch(step, size)
        with torch.no_grad():
            want, want64 = loss_fn(dense(x), y), loss_fn(dense64(x), y)
        got = engine.eval_step(x, y)
        agree(got, want, want64, f"eval loss at step {step + 1}", length=max(size * T, V))
        assert all(p.grad is None for p in stage.parameters()), "eval touched a gradient"
        assert all(mod.training for mod in stage.modules()), "modes not restored"
        engine.train_step(x, y)  # a training step between evaluations
        assert any(p.grad is not None for p in stage.parameters())
        stage.zero_grad()


@pytest.mark.parametrize(
    "pp, schedule, m, v",
    [
        (2, "gpipe", 4, 1),
        (2, "1f1b", 3, 1),
        (4, "1f1b", 4, 1),
        (2, "interleaved", 4, 2),
        (4, "interleaved", 4, 2),
    ],
)
def test_eval_step_equals_unpipelined(pp, schedule, m, v):
    run_ranks(_eval, pp, schedule, m, v)


def test_eval_step_with_tuple_messages():
    run_ranks(_eval, 2, "interleaved", 2, 2, make=tuple_blocks, n=4)


def test_forward_only_schedule():
    assert ForwardOnly(3).steps(2, 1) == [("F", 0), ("F", 1), ("F", 2)]
    only = make_schedule("interleaved", 4, 2).forward_only()
    assert only == ForwardOnly(4, 2)
    assert [(i, c) for _, i, c in only.actions(2, 0)] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (2, 0),
        (3, 0),
        (2, 1),
        (3, 1),
    ]
    assert ForwardOnly(8).bubble_fraction(4) == pytest.approx(3 / 11)


def _engine_refuses_forward_only() -> None:
    mesh = make_mesh(pp=2)
    stage, _ = build_stage(blocks(2), 2, mesh.pp_rank)
    PipelineEngine(stage, mesh, ForwardOnly(2), loss_fn=loss_fn)


def test_engine_needs_a_training_schedule():
    with pytest.raises(Exception, match="ForwardOnly has no backward: give the engine a training"):
        run_ranks(_engine_refuses_forward_only, 2)


# -- the trainer's validation loss --------------------------------------------------------------
SMALL = tiny_config(steps=4)


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=1, pp=2, dp=2, ep=2, zero=1, schedule="1f1b"),
        dict(tp=1, pp=2, dp=2, ep=1, zero=0, schedule="interleaved", virtual_stages=2),
    ],
    ids=["1f1b", "interleaved"],
)
def test_trainer_val_loss_equals_single_process(layout):
    """--eval-every 2: the val_loss of steps 2 and 4 equals the single-process model's on the
    held-out batches (and training reads only the ids before them, or the losses differ)."""
    from fastpar.train import TrainConfig
    from fastpar.verify import compare

    ok, text = compare(
        TrainConfig.from_flags(**{**SMALL, **layout, "eval_every": 2, "eval_batches": 2})
    )
    assert ok, text
    assert "val_loss" in text and "\n    2 " in text.split("val_loss")[1]


def test_val_loss_in_the_log_line_and_metrics(tmp_path, capsys):
    import json

    from fastpar.train import TrainConfig, launch

    metrics = tmp_path / "m.jsonl"
    cfg = TrainConfig.from_flags(
        **{
            **SMALL,
            "quiet": False,
            "tp": 1,
            "pp": 2,
            "dp": 1,
            "ep": 1,
            "eval_every": 3,
            "log_every": 10,
            "metrics_file": str(metrics),
        }
    )
    records = launch(cfg)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4]  # evaluated steps are logged; 4 is the last
    assert all(isinstance(r["val_loss"], float) and r["val_loss"] > 0 for r in rows)
    assert [r.get("val_loss") for r in records] == [
        None,
        None,
        rows[0]["val_loss"],
        rows[1]["val_loss"],
    ]


def test_held_out_split_rule():
    from fastpar.train import TrainConfig
    from fastpar.train.batches import check_split, split_tokens

    tokens = torch.arange(1000)
    train, held = split_tokens(TrainConfig.from_flags(eval_every=5, eval_split=0.1), tokens)
    assert torch.equal(train, tokens[:900]) and torch.equal(held, tokens[900:])
    assert split_tokens(TrainConfig.from_flags(), tokens) == (
        tokens,
        None,
    )  # no --eval-every: all ids
    with pytest.raises(ValueError, match="each part needs seq_len"):
        check_split(TrainConfig.from_flags(eval_every=1, eval_split=0.01, seq_len=64), tokens)
