"""Hybrid sharding in the trainer: --dp-shard / --dp-replicate parsed, refused where impossible
(naming the flags and the fix), printed at start with the groups; ``fastpar.verify`` AGREEs at
dp-shard 2 x dp-replicate 2 for ZeRO 1 (with experts, ep 2), ZeRO 2 and 3 with tp 2, ZeRO 2
in bf16, expert-bias routing with ep 2, ZeRO 3 with cp 2 (ZeRO 3 alone and in fp16, the
pipelines, sequence parallelism and more: tests/test_verify_matrix.py's hsdp cases); a run
resumes across hybrid and full sharding (slow: 4 ranks take 6-25 s
each here, 8 ranks up to 75 s)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _flags import tiny_config

from fastpar import ParallelMesh, checkpoint, verify
from fastpar.mesh import MeshLayout
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, launch, load_data
from fastpar.train.build import build
from fastpar.train.cli import build_parser
from fastpar.train.config import config_from
from fastpar.train.config_checks import mesh_layout
from fastpar.train.memory import stage_bytes
from fastpar.train.summary import header_line, hybrid_line
from fastpar.verify import compare, references

SMALL = tiny_config(steps=3, seq_len=32)
FOUR = dict(tp=1, pp=1, dp=4, ep=1)
BIAS = dict(moe_every=1, expert_bias=True, bias_update_rate=1e-2)


def test_flags_parse_and_print_the_groups():
    ns = build_parser().parse_args(["--dp", "4", "--dp-shard", "2", "--dp-replicate", "2"])
    assert (ns.dp_shard, ns.dp_replicate) == (2, 2)
    cfg = TrainConfig.from_flags(**SMALL, **FOUR, zero=1, dp_shard=2)
    cfg.check()
    assert "world 4 = dp 4 (dp-shard 2 x dp-replicate 2) x tp 1" in header_line(cfg, "gloo", 9, 9)
    plain = TrainConfig.from_flags(**SMALL, **FOUR, zero=1)
    assert "dp-shard" not in header_line(plain, "gloo", 9, 9)
    line = hybrid_line(cfg, MeshLayout(4, dp_shard=2))
    assert line == (
        "hybrid sharding: dp 4 = dp-shard 2 x dp-replicate 2; ZeRO-1 shards over dp-shard "
        "[0, 1] [2, 3], all-reduces each reduced shard over dp-replicate [0, 2] [1, 3]"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(dp_shard=3, dp_replicate=2),
            r"^--dp 4, --dp-shard 3 and --dp-replicate 2 disagree: --dp must be --dp-shard x "
            r"--dp-replicate = 6; give any two of the three and the third follows$",
        ),
        (dict(dp_replicate=3), r"--dp-replicate 3 does not divide --dp 4"),
        (dict(dp_shard=2, zero=0), r"with --zero 0: .*pass --zero 1, 2 or 3"),
        (dict(dp_shard=1, ep=2), r"ep to divide --dp-shard\*cp = 1\*1 = 1"),
    ],
)
def test_impossible_hybrid_runs_are_refused(kwargs, message):
    cfg = TrainConfig.from_flags(**SMALL, **{**FOUR, "zero": 1, **kwargs})
    with pytest.raises(ValueError, match=message):
        cfg.check()


@pytest.mark.parametrize("command", ["train", "verify"])
@pytest.mark.parametrize(
    "flags, sizes",
    [
        (["--dp-shard", "2", "--dp-replicate", "2"], (4, 2, 2)),  # dp = S x R, not --dp's 2
        (["--dp", "4", "--dp-shard", "2"], (4, 2, 2)),
        (["--dp", "4", "--dp-replicate", "2"], (4, 2, 2)),
        (["--dp", "8", "--dp-shard", "2", "--dp-replicate", "4"], (8, 2, 4)),
    ],
)
def test_any_two_of_dp_shard_and_replicate_give_the_third(command, flags, sizes):
    """The issue's command, ``fastpar.verify --dp-shard 2 --dp-replicate 2 --tp 1 --pp 1 --ep 1
    --zero 1``, was refused: --dp kept its default of 2. Parsed as train and verify parse."""
    parser = build_parser() if command == "train" else verify.parser()
    argv = [*flags, "--tp", "1", "--pp", "1", "--ep", "1", "--zero", "1"]
    cfg = config_from(parser.parse_args(argv), world=None)
    cfg.check()
    layout = mesh_layout(cfg)
    assert (cfg.dp, layout.dp_shard, layout.dp_replicate) == sizes
    assert cfg.world_size == sizes[0]


def test_the_activation_planner_is_the_same_for_every_split_of_dp():
    """A rank's activations depend on its rows (batch / dp), not on how dp is split."""
    plain = TrainConfig.from_flags(**SMALL, **FOUR, zero=3)
    for split in (dict(dp_shard=2), dict(dp_shard=1), dict(dp_shard=4)):
        cfg = TrainConfig.from_flags(**SMALL, **FOUR, zero=3, **split)
        cfg.check()
        assert stage_bytes(cfg) == stage_bytes(plain) and stage_bytes(cfg)[0] > 0, split


def _built(zero: int) -> list:
    cfg = TrainConfig.from_flags(**SMALL, **{**FOUR, "ep": 2}, zero=zero, dp_shard=2)
    mesh = ParallelMesh(cfg.tp, cfg.pp, cfg.ep, dp_shard=cfg.dp_shard)
    parts = build(cfg, mesh, torch.device("cpu"))
    return [(f.expert, f.sharded, f.size, f.replicate_size) for f in parts.opt.flats]


@pytest.mark.parametrize("zero", [2, 3])
def test_the_trainer_shards_over_the_shard_groups(zero):
    """The trainer's wrapper takes the mesh's hybrid groups: dense flats shard over dp-shard (2
    ranks), experts over expert-dp-shard (dp-shard 2 / ep 2 = 1 rank), each all-reduced over
    its 2 replicas — not over the whole dp."""
    for flats in run_ranks(_built, 4, zero):
        assert {(e, sharded, size, reps) for e, sharded, size, reps in flats} == {
            (False, True, 2, 2),
            (True, True, 1, 2),
        }


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        # (ZeRO 3 alone and in fp16, with pp 2 every schedule, ZeRO 3 with experts, ZeRO 1 with
        # tp 2 and sequence parallelism: tests/test_verify_matrix.py's hsdp cases)
        dict(zero=1, ep=2),
        dict(zero=2, tp=2),  # 8 ranks, about 75 s here
        dict(zero=3, cp=2, dp=2, dp_shard=1, moe_every=0),  # ZeRO shards over the cp ranks
        dict(zero=2, precision="bf16"),
        dict(zero=3, tp=2, moe_every=0),  # 8 ranks
        # aux-loss-free balancing: the expert-bias counts summed over the whole dp
        dict(zero=2, ep=2, experts=8, top_k=2, router_score="sigmoid", **BIAS),
    ],
    ids=[
        "zero1-moe",
        "zero2-tp2",
        "zero3-cp2",
        "zero2-bf16",
        "zero3-tp2",
        "zero2-ep2-expert-bias",
    ],
)
def test_verify_agrees_under_hybrid_sharding(layout):
    cfg = TrainConfig.from_flags(**{**SMALL, **FOUR, "dp_shard": 2, "dp_replicate": 2, **layout})
    ok, text = compare(cfg)
    assert ok, text
    shard = layout.get("dp_shard", 2)
    assert f"(dp-shard {shard} x dp-replicate 2)" in text.splitlines()[0]


HSDP = dict(dp_shard=2, dp_replicate=2)
FULL = dict(dp_shard=None, dp_replicate=None)
FULL4 = dict(dp_shard=4, dp_replicate=None)  # --dp-shard 4 at dp 4: full sharding, spelled out


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved, other, same",
    [(HSDP, [FULL, FULL4], [HSDP]), (FULL, [HSDP], [FULL4])],
    ids=["hsdp-to-full", "full-to-hsdp"],
)
def test_resume_across_hybrid_and_full_sharding(tmp_path, saved, other, same):
    """A ZeRO-3 run saved at one split of dp 4 resumes at another (``other``): its first step's
    loss is the uninterrupted run's, bit for bit (parameters, optimizer state and data position
    come back exactly; the loss is the same sum of the same per-rank losses), and --dp 4 and
    --dp-shard 4 continue alike, bit for bit. Resumed in the saved split (``same``, spelled
    either way), every step is the uninterrupted run's, bit for bit. Past the first step a new
    split sums the gradients in another order, so it is not bit-identical: it is judged, every
    loss and every final parameter, by ``fastpar.verify``'s rule against the uninterrupted
    math in float64 (the state it resumed from is that math's, exactly)."""
    base = dict(SMALL, **FOUR, zero=3, moe_every=0, steps=4)
    cfg = TrainConfig.from_flags(**{**base, **saved})
    full = [r["loss"] for r in launch(cfg)]
    ckpt = str(tmp_path / "ckpt")
    launch(
        TrainConfig.from_flags(
            **{**base, **saved, "steps": 2, "checkpoint_dir": ckpt, "save_every": 2}
        )
    )

    def resume(layout: dict) -> tuple[list[float], dict]:
        copy = shutil.copytree(ckpt, tmp_path / f"copy{len(os.listdir(tmp_path))}")
        cfg = TrainConfig.from_flags(
            **{**base, **layout, "checkpoint_dir": str(copy), "resume": True}
        )
        records = launch(cfg)  # (a resumed run saves its last step: each one resumes a copy)
        assert [r["step"] for r in records] == [3, 4], layout
        out = str(copy / "export.pt")
        checkpoint.export_state_dict(str(copy / "step_000004"), out)
        return [r["loss"] for r in records], torch.load(out, weights_only=True)

    for layout in same:
        assert resume(layout)[0] == full[2:], layout
    others = [resume(layout) for layout in other]
    refs = references(cfg, load_data(cfg))
    for layout, (losses, params) in zip(other, others, strict=True):
        assert losses[0] == full[2], layout
        assert losses == others[0][0], layout
        judged = [refs.loss(step, v) for step, v in enumerate(losses, start=2)]
        judged += [refs.param(name, p.double()) for name, p in params.items()]
        bad = [str(c) for c in judged if not c.ok]
        assert not bad and len(judged) > 2, (layout, bad[:6])
