"""The fastpar DeepSeek under context parallelism and with multi-token prediction: every
parameter's gradient on every rank against the single-process model (``fastpar.verify``'s
references) at CP 2 (ring and all-to-all, packed documents), CP 2 x TP 2 and PP 2 with MTP;
``fastpar.verify --model deepseek`` AGREE at tp2 x pp2 x dp2 x ep2 with MTP and ZeRO-1, at
cp2 x tp2, and with MTP at tp2 x pp2 interleaved with the fused cross-entropy and recompute and
under ZB-H1; what the trainer cannot run refused. Tolerances: ``fastpar.tolerance``'s rule. The
MTP weights under DeepSeek-V3's HF names and their export: tests/test_models_deepseek_hf.py."""

from __future__ import annotations

import pytest
import torch
from _flags import DEEPSEEK, tiny_config
from _model_runs import mla_sizes
from _trainer import FIRST_STEP, every_gradient_agrees, first_step_gradients, write_documents

from fastpar.train import TrainConfig

# q/k head 6 + 4 = 10 wide, v 5: K and V of other widths around the ring
SMALL = tiny_config(
    FIRST_STEP, DEEPSEEK, model_type="deepseek", experts=4, **mla_sizes(10, 12, 4, 6, 5)
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("dsp") / "docs.txt")


@pytest.mark.parametrize(
    "layout",
    [
        dict(cp=2, tp=1, pp=1),
        pytest.param(
            dict(cp=2, tp=1, pp=1, cp_attention="all-to-all", reset_positions=False),
            marks=pytest.mark.slow,
        ),
        pytest.param(dict(cp=2, tp=1, pp=1, pack="stream"), marks=pytest.mark.slow),
        pytest.param(dict(cp=2, tp=2, pp=1, sequence_parallel=True), marks=pytest.mark.slow),
        dict(cp=2, tp=2, pp=1, cp_attention="all-to-all", heads=8, mtp_depth=1),
        dict(tp=1, pp=2, mtp_depth=1),
        pytest.param(
            dict(tp=2, pp=2, mtp_depth=1, untied=True, sequence_parallel=True),
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "cp2-ring-docs",
        "cp2-a2a-docs-no-reset",
        "cp2-ring-stream",
        "cp2-tp2-sp",
        "cp2-tp2-a2a-mtp",
        "pp2-mtp",
        "tp2-pp2-mtp-untied-sp",
    ],
)
def test_every_gradient_on_every_rank_is_the_single_process_models(data, layout):
    cfg = TrainConfig.from_flags(**{**SMALL, **layout}, data=data)
    results = every_gradient_agrees(cfg)
    if cfg.model.mtp_depth:
        assert sum(int(lines[0].split()[3]) for lines in results) > 0  # the last stage's MTP


def test_the_cp_gradient_check_fails_with_the_positions_of_one_chunk(data):
    """The check above can fail: MLA's rotary dims rotated at 0..t-1 on every cp rank (the
    local positions, not the load-balanced chunks' global ones) disagree."""
    from fastpar.testing import run_ranks
    from fastpar.verify import references

    cfg = TrainConfig.from_flags(**{**SMALL, "cp": 2, "tp": 1, "pp": 1}, data=data)
    refs = references(cfg, None)
    lines = run_ranks(_local_positions, cfg.world_size, cfg, refs)
    assert all(len(r) > 1 and "attn." in "\n".join(r) for r in lines), lines


def _local_positions(cfg, refs):
    import fastpar.models.mla as mla

    mla.positions = lambda t, cp_group, device: torch.arange(t, device=device)
    return first_step_gradients(cfg, refs)


# -- fastpar.verify: the trainer's run against one device ---------------------------------------
VERIFY = tiny_config(DEEPSEEK, model_type="deepseek", steps=3, layers=3)


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, dp=2, ep=2, zero=1, mtp_depth=1),
        pytest.param(dict(cp=2, tp=2, pp=1, dp=1, ep=1, zero=0), marks=pytest.mark.slow),
    ],
    ids=["tp2-pp2-dp2-ep2-mtp1-z1", "cp2-tp2"],
)
def test_verify_deepseek_agrees(layout):
    from fastpar.verify import compare

    cfg = TrainConfig.from_flags(**VERIFY, **layout)
    ok, text = compare(cfg)
    assert ok, text
    assert text.endswith("AGREE")


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(
            dict(schedule="interleaved", virtual_stages=2, layers=4, fused_ce=True, recompute=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(dict(schedule="zb-h1"), marks=pytest.mark.slow),
    ],
    ids=["interleaved-fused-ce-recompute", "zb-h1"],
)
def test_verify_deepseek_mtp_agrees_under_the_schedules(schedule):
    """MTP's head (a MoE block, the shared embedding's copy on the last stage) under the
    interleaved schedule with the fused cross-entropy and full recompute, and under ZB-H1's
    split backward: the trainer's run at tp 2 x pp 2 against one device."""
    from fastpar.verify import compare

    layout = dict(tp=2, pp=2, dp=1, ep=1, zero=0, steps=2, mtp_depth=1)
    cfg = TrainConfig.from_flags(**{**VERIFY, **layout, **schedule})
    ok, text = compare(cfg)
    assert ok, text
    assert text.endswith("AGREE")


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(mtp_depth=16), r"mtp_depth \(--mtp-depth\) 16 must be below seq_len 16"),
        (dict(mtp_loss_coef=0.3), r"has no effect without MTP modules"),
        (dict(cp=2, cp_attention="all-to-all", heads=2, tp=2), r"must divide by it"),
        (dict(cp=3), r"not divisible by 6"),
    ],
)
def test_the_trainer_refuses_what_it_cannot_run(flags, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**{**VERIFY, **flags}).check()
