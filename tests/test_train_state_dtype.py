"""``--optimizer-state-dtype bf16`` in the training command: ``fastpar.verify`` AGREEs (its
float64 reference stores the moments rounded to bf16, as the run does, and allows what a
neighbouring rounding moves a parameter by: docs/tolerances.md), and DISAGREEs with a run whose
ranks quietly keep fp32 moments; checkpoints store the moments in bf16 and a resumed run goes
on bit for bit; resuming with another --optimizer-state-dtype is refused."""

from __future__ import annotations

import json
import os

import pytest
from _flags import tiny_config

import fastpar.train.build
from fastpar.launch import RankError
from fastpar.train import TrainConfig, launch
from fastpar.verify import compare

SMALL = tiny_config(steps=3, seq_len=32)
DP2 = dict(tp=1, pp=1, dp=2, ep=1, moe_every=0, optimizer_state_dtype="bf16")


TINY = tiny_config(batch_size=4, hidden=16, heads=2, layers=1)


def test_verify_agrees_with_bf16_state():
    ok, text = compare(TrainConfig.from_flags(**TINY, **DP2, zero=1))
    assert ok, text
    assert text.splitlines()[0].endswith("AdamW moments in bf16"), text


# (at tp 2 x pp 2 x dp 2 x ep 2, every ZeRO stage, fp32 / bf16 / fp16: tests/test_verify_matrix.py's
# bf16state cases)


@pytest.mark.slow
def test_verify_catches_ranks_that_keep_fp32_moments(monkeypatch):
    """The planted fault: the distributed ranks build fp32 moments while the references model
    bf16 ones (the ranks are forked: the patch reaches them). The float64 reference stores
    the moments rounded as the run should, so the gradient norm of a later step is off (over
    6 steps: the same run correct AGREEs first)."""
    cfg = TrainConfig.from_flags(**{**SMALL, "steps": 6}, **DP2, zero=1)
    ok, text = compare(cfg)
    assert ok, text
    real = fastpar.train.build._optimizer

    def fp32_on_ranks(cfg, stage, groups, mesh, *args, **kwargs):
        if mesh is not None:
            cfg = cfg.with_flags(optimizer_state_dtype="fp32")
        return real(cfg, stage, groups, mesh, *args, **kwargs)

    monkeypatch.setattr(fastpar.train.build, "_optimizer", fp32_on_ranks)
    ok, text = compare(cfg)
    assert not ok and text.splitlines()[-1] == "DISAGREE", text


def _saved_dtypes(step_dir: str) -> dict[str, str]:
    """{key: dtype} of the optimizer state keys a checkpoint's metadata records."""
    with open(os.path.join(step_dir, "metadata.json")) as f:
        tensors = json.load(f)["tensors"]
    out: dict[str, str] = {}
    for info in tensors.values():
        for key, k in info["keys"].items():
            out.setdefault(key, k["dtype"])
    return out


@pytest.mark.parametrize("zero", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_resume_with_bf16_state_is_bit_identical(tmp_path, zero):
    base = dict(SMALL, **DP2, zero=zero, steps=4)
    full = launch(TrainConfig.from_flags(**base))
    ckpt = str(tmp_path / "ckpt")
    launch(TrainConfig.from_flags(**{**base, "steps": 2, "checkpoint_dir": ckpt, "save_every": 2}))
    saved = _saved_dtypes(os.path.join(ckpt, "step_000002"))
    assert saved["exp_avg"] == saved["exp_avg_sq"] == "torch.bfloat16", saved
    resumed = launch(TrainConfig.from_flags(**{**base, "checkpoint_dir": ckpt, "resume": True}))
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[2:]]
    # another dtype of the moments: refused, naming the flag
    with pytest.raises(RankError, match=r"--optimizer-state-dtype bf16 -> fp32"):
        launch(
            TrainConfig.from_flags(
                **{
                    **base,
                    "checkpoint_dir": ckpt,
                    "resume": True,
                    "optimizer_state_dtype": "fp32",
                    "steps": 6,
                }
            )
        )


def test_the_header_names_the_state_dtype():
    from fastpar.train.summary import header_line

    assert "AdamW moments in bf16" in header_line(
        TrainConfig.from_flags(**TINY, **DP2), "gloo", 9, 9
    )
    assert "moments" not in header_line(
        TrainConfig.from_flags(**TINY, **DP2 | {"optimizer_state_dtype": "fp32"}), "gloo", 9, 9
    )


def test_muon_with_bf16_state_is_refused():
    """Muon keeps fp32 state: asking for bf16 moments with it is refused, never ignored."""
    cfg = TrainConfig.from_flags(**SMALL, optimizer="muon", optimizer_state_dtype="bf16")
    with pytest.raises(ValueError, match="--optimizer muon --optimizer-state-dtype bf16: Muon"):
        cfg.check()
