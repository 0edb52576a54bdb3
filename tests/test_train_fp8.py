"""``python -m fastpar.train --precision fp8 --fp8-recipe R`` (issue 47, points 1 and 8): the
tiny Llama trains at TP 2 on CPU with every recipe, the loss finite and going down; its linear
layers run in fp8 while the embedding and the head stay in bf16; with MoE blocks at EP 2 (and
expert TP 2) their routed experts run in fp8 too, the routers in bf16; a checkpoint saved under fp8
holds fp32 masters and resumes under bf16; a layer shape the recipe cannot scale is refused
before any step, naming the module."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from _flags import tiny_config

from fastpar.launch import RankError
from fastpar.train import TrainConfig, launch

#: a Llama whose every fp8 operand fits the blocks of 128 at TP 2 (q|k|v: 384 rows a rank,
#: gate|up: 128 of each a rank, o and down: 128 input columns a rank)
LLAMA = tiny_config(
    model_type="llama",
    hidden=256,
    heads=4,
    ffn=256,
    layers=1,
    seq_len=16,
    batch_size=4,
    tp=2,
    pp=1,
    dp=1,
    ep=1,
    moe_every=0,
    lr=1e-2,
    warmup=0,
    precision="fp8",
)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_llama_trains_at_tp2(recipe):
    records = launch(TrainConfig.from_flags(**{**LLAMA, "steps": 6, "fp8_recipe": recipe}))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses


def _losses(**changes) -> list[tuple[float, float]]:
    records = launch(TrainConfig.from_flags(**{**LLAMA, "steps": 4, **changes}))
    return [(r["loss"], r["grad_norm"]) for r in records]


def test_zero_bubble_equals_1f1b_in_fp8():
    """zb-h1 runs the fp8 Function's backward in both its B and its W pass (its gradient's amax
    max-reduction over TP too, alike on every TP rank): the same losses and norms, bit for bit."""
    pp = dict(pp=2, layers=2, microbatches=2, sequence_parallel=True)
    assert _losses(**pp, schedule="zb-h1") == _losses(**pp, schedule="1f1b")


LAYOUTS = {
    "dp2-zero3": dict(dp=2, zero=3),
    "dp2-zero1-recompute": dict(dp=2, zero=1, recompute="full"),
    "cp2": dict(cp=2),
    "moe-ep2-dp2": dict(moe_every=1, ep=2, dp=2, moe_ffn=128),  # the experts in fp8 too
    "moe-ep2-etp2": dict(moe_every=1, ep=2, dp=2, moe_ffn=128, moe_expert_tp=True),
    "pp2-interleaved-sp": dict(
        pp=2, layers=4, schedule="interleaved", virtual_stages=2, sequence_parallel=True
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_trains_under_other_layouts(layout):
    losses = [loss for loss, _ in _losses(**LAYOUTS[layout], microbatches=2)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def _fp8_layers(cfg: TrainConfig) -> list[str]:
    from _mesh import make_mesh

    from fastpar.train import Trainer

    mesh = make_mesh(cfg.tp, cfg.pp, cfg.ep, cp=cfg.cp)
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    return [n for n, m in trainer.model.named_modules() if getattr(m, "fp8", None) is not None]


def test_the_linear_layers_are_fp8_and_the_rest_is_not():
    from fastpar.testing import run_ranks

    names = run_ranks(_fp8_layers, 2, TrainConfig.from_flags(**LLAMA))[0]
    assert names and all(n.rsplit(".", 1)[-1] in ("qkv", "o", "gate_up", "down") for n in names)
    none = TrainConfig.from_flags(**{**LLAMA, "fp8_exclude": "*"})
    assert run_ranks(_fp8_layers, 2, none)[0] == []


MOE = dict(moe_every=1, ep=2, dp=2, moe_ffn=128)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_llama_with_moe_blocks_trains_at_ep2_with_its_experts_in_fp8(recipe):
    """The MoE blocks' routed experts (``module.1.mlp``) take fp8 with the linear layers, each
    expert's GEMMs scaled on their own (``fastpar.moe.fp8_experts``); the router stays bf16."""
    from fastpar.testing import run_ranks

    flags = {**LLAMA, **MOE, "fp8_recipe": recipe}
    assert "module.1.mlp" in run_ranks(_fp8_layers, 4, TrainConfig.from_flags(**flags))[0]
    losses = [r["loss"] for r in launch(TrainConfig.from_flags(**{**flags, "steps": 6}))]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_a_run_saved_in_fp8_resumes_in_bf16(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    base = dict(LLAMA, checkpoint_dir=ckpt, save_every=2, lr_schedule="constant")
    first = launch(TrainConfig.from_flags(**{**base, "steps": 2}))
    assert math.isfinite(first[-1]["loss"])
    with open(os.path.join(ckpt, "step_000002", "metadata.json")) as f:
        tensors = json.load(f)["tensors"]
    for name, info in tensors.items():  # the model in bf16, its masters in fp32
        assert info["keys"]["model"]["dtype"] == "torch.bfloat16", name
        assert info["keys"]["param"]["dtype"] == "torch.float32", name
    bf16 = launch(
        TrainConfig.from_flags(**{**base, "precision": "bf16", "steps": 4, "resume": True})
    )
    assert [r["step"] for r in bf16] == [3, 4] and all(math.isfinite(r["loss"]) for r in bf16)
    back = launch(TrainConfig.from_flags(**{**base, "steps": 6, "resume": True}))  # and back to fp8
    assert [r["step"] for r in back] == [5, 6] and all(math.isfinite(r["loss"]) for r in back)


def test_a_shape_blockwise_cannot_scale_is_refused_naming_the_module():
    cfg = TrainConfig.from_flags(**{**LLAMA, "hidden": 64, "ffn": 128, "fp8_recipe": "blockwise"})
    with pytest.raises(RankError, match=r"fp8 blockwise: .*qkv \(ColumnParallelLinear 64 ->"):
        launch(cfg)


def test_the_header_names_the_recipe():
    from fastpar.train.summary import header_line

    text = header_line(TrainConfig.from_flags(**{**LLAMA, "fp8_recipe": "rowwise"}), "gloo", 1, 1)
    assert ", fp8 rowwise, " in text


def test_verify_refuses_fp8(capsys):
    from _flags import tiny_argv

    from fastpar.verify import main

    assert main(tiny_argv(precision="fp8", tp=2, pp=1, dp=1, ep=1, moe_every=0)) == 2
    err = capsys.readouterr().err
    assert "fastpar.verify --precision fp8: its float64 reference has no fp8 rounding" in err


def _hf_llama(tmp_path, intermediate: int) -> str:
    pytest.importorskip("transformers")
    from _hf import config as hf_config

    path = tmp_path / f"llama{intermediate}.json"
    cfg = hf_config("llama", vocab_size=300, intermediate_size=intermediate)
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


def test_a_parallelized_hf_model_trains_in_fp8_and_a_bad_shape_is_refused(tmp_path):
    """--hf-config: the plan's Column / Row layers are fastpar's, so they take fp8 alike (the
    lm_head stays bf16); an MLP of 40 rows (20 a rank) is refused naming the module."""
    from _flags import HF_RUN

    run = dict(HF_RUN, steps=4, ep=1, tp=2, pp=1, dp=1, precision="fp8", lr=1e-2, warmup=0)
    records = launch(TrainConfig.from_flags(**run, hf_config=_hf_llama(tmp_path, 64)))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    with pytest.raises(RankError, match=r"fp8 tensorwise: 1\.model\.layers\.0\.mlp\.gate_proj "):
        launch(TrainConfig.from_flags(**run, hf_config=_hf_llama(tmp_path, 40)))


def test_compiled_blocks_train_in_fp8_like_eager():
    """--compile with blockwise (whose fp8 Function then runs eagerly: inductor fails on its
    block scales, torch 2.13): the losses of compiled blocks follow eager's (other fusions of
    the bf16 rest: not bit for bit)."""
    blockwise = dict(LLAMA, steps=2, fp8_recipe="blockwise")
    eager = [r["loss"] for r in launch(TrainConfig.from_flags(**blockwise))]
    compiled = [r["loss"] for r in launch(TrainConfig.from_flags(**blockwise, compile=True))]
    assert all(abs(c - e) < 1e-2 * abs(e) for c, e in zip(compiled, eager, strict=True))
