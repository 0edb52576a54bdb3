"""DeepSeek-V3-style MoE routing in the training command: the flags reach the model's MoE
blocks, bad combinations are one line naming the value and the fix, the expert bias moves
after each optimizer step (not after a skipped one), checkpoints keep it (a resumed run equals
an uninterrupted one), and ``fastpar.verify`` proves DP2 x EP2 under ZeRO-1 / ZeRO-2 equal to
the single-process model, biases included."""

from __future__ import annotations

import math

import pytest
import torch
from _flags import tiny_argv, tiny_config, with_hf_config
from _no_ranks import forbid_ranks

from fastpar import checkpoint
from fastpar.models import GPTConfig, LlamaConfig, build_model
from fastpar.moe import MoE
from fastpar.train import TrainConfig, build_parser, config_from, launch, main
from fastpar.train.build import build
from fastpar.verify import compare, reference

SMALL = tiny_config(steps=3, seq_len=32)
# sigmoid scores, a routed scaling factor, 2 of 4 groups, expert bias, a gated shared expert,
# the per-sequence balancing loss and a z-loss: DeepSeek-V3's MoE block in small
DEEPSEEK = dict(
    moe_every=1,
    experts=8,
    top_k=2,
    router_score="sigmoid",
    routed_scaling_factor=2.5,
    router_groups=4,
    router_group_topk=2,
    expert_bias=True,
    bias_update_rate=1e-2,
    shared_expert_ffn=16,
    shared_expert_gate=True,
    aux_loss="sequence",
    aux_loss_coef=1e-3,
    z_loss_coef=1e-3,
)
LLAMA = dict(model_type="llama", kv_heads=2, ffn=48)
DP2_EP2 = dict(tp=1, pp=1, dp=2, ep=2)
FLAGS = [
    "--model",
    "llama",
    "--moe-every",
    "1",
    "--experts",
    "8",
    "--top-k",
    "2",
    "--router-score",
    "sigmoid",
    "--routed-scaling-factor",
    "2.5",
    "--router-groups",
    "4",
    "--router-group-topk",
    "2",
    "--expert-bias",
    "--bias-update-rate",
    "0.01",
    "--shared-expert-ffn",
    "16",
    "--shared-expert-gate",
    "--aux-loss",
    "sequence",
    "--aux-loss-coef",
    "0.001",
    "--z-loss-coef",
    "0.001",
]


def _moes(model_cfg) -> list[MoE]:
    torch.manual_seed(0)
    return [m for b in build_model(model_cfg) for m in b.modules() if isinstance(m, MoE)]


def _biases(path: str, out) -> dict[str, torch.Tensor]:
    checkpoint.export_state_dict(path, str(out))
    state = torch.load(str(out), weights_only=True)
    return {k: v for k, v in state.items() if k.endswith("expert_bias")}


# -- flags -> config -> MoE -------------------------------------------------------------------
def test_flags_reach_the_llama_moe_blocks():
    cfg = config_from(build_parser().parse_args(FLAGS))
    assert {k: cfg.flags()[k] for k in DEEPSEEK} == DEEPSEEK
    cfg.check()
    model_cfg = cfg.model
    assert isinstance(model_cfg, LlamaConfig) and model_cfg.moe_router.num_groups == 4
    moes = _moes(model_cfg)
    assert len(moes) == cfg.model.layers
    for m in moes:
        r = m.router
        assert (r.score, r.scaling_factor, r.num_groups, r.group_topk) == ("sigmoid", 2.5, 4, 2)
        assert r.expert_bias is not None and r.expert_bias.dtype == torch.float32
        assert r.bias_update_rate == 1e-2 and r.normalize_topk
        assert (r.aux_loss, r.aux_loss_coef, r.z_loss_coef) == ("sequence", 1e-3, 1e-3)
        assert m.expert == "swiglu" and m.shared is not None and m.shared_gate is not None
        assert m.shared.w2.shape == (16, cfg.model.hidden)


def test_the_command_trains_with_the_routing_flags(capsys):
    small = tiny_argv(DP2_EP2, ffn=48, kv_heads=2, seq_len=32, quiet=False)
    assert main([*FLAGS, *small]) == 0
    assert "done: loss" in capsys.readouterr().out


def test_gpt_takes_the_routing_options_too():
    cfg = TrainConfig.from_flags(
        **{**SMALL, **DP2_EP2, **DEEPSEEK, "aux_loss": "none", "aux_loss_coef": 1e-2}
    )
    cfg.check()
    model_cfg = cfg.model
    assert isinstance(model_cfg, GPTConfig)
    (m, *_) = _moes(model_cfg)
    assert m.expert == "mlp" and m.router.score == "sigmoid" and m.router.aux_loss is None
    assert m.router.expert_bias is not None and m.shared is not None


def test_defaults_build_the_same_moe_as_before():
    """Every routing field at its default: today's router, and the same random stream."""
    plain = _moes(LlamaConfig(moe_every=2, layers=2))
    for m in plain:
        assert m.router.score == "softmax" and m.router.expert_bias is None and m.shared is None
        assert m.router.aux_loss == "micro_batch" and m.router.aux_loss_coef == 1e-2
    assert not any(name.endswith("expert_bias") for m in plain for name, _ in m.named_buffers())


ERRORS = [
    (dict(router_group_topk=2), "router_group_topk (--router-group-topk) 2 needs router_groups"),
    (dict(router_groups=4), "router_groups (--router-groups) 4 needs router_group_topk"),
    (
        dict(router_groups=3, router_group_topk=1),
        "router_groups (--router-groups) 3 must divide "
        "the 8 experts (--experts) into equal groups: use a divisor of 8",
    ),
    (
        dict(router_groups=4, router_group_topk=5),
        "router_group_topk (--router-group-topk) 5 must be in [1, 4]",
    ),
    (
        dict(router_groups=4, router_group_topk=1, top_k=3),
        "top_k 3 (--top-k) exceeds the 2 "
        "experts in 1 groups of 2: raise router_group_topk (--router-group-topk) to 2",
    ),
    (dict(router_score="relu"), "router_score (--router-score) 'relu' must be one of"),
    (dict(aux_loss="global"), "aux_loss (--aux-loss) 'global' must be one of"),
    (
        dict(routed_scaling_factor=0.0),
        "routed_scaling_factor (--routed-scaling-factor) 0.0 must be a positive finite number",
    ),
    (
        dict(bias_update_rate=1e-2),
        "bias_update_rate (--bias-update-rate) 0.01 has no effect "
        "without expert_bias: add --expert-bias",
    ),
    (
        dict(expert_bias=True, bias_update_rate=0.0),
        "bias_update_rate (--bias-update-rate) 0.0 must be a finite number > 0",
    ),
    (
        dict(aux_loss="none", aux_loss_coef=0.1),
        "aux_loss_coef (--aux-loss-coef) 0.1 has no effect with aux_loss none",
    ),
    (dict(z_loss_coef=-1.0), "z_loss_coef (--z-loss-coef) -1.0 must be a finite number >= 0"),
    (
        dict(shared_expert_gate=True),
        "shared_expert_gate (--shared-expert-gate) needs a shared "
        "expert: set shared_expert_ffn (--shared-expert-ffn N",
    ),
    (dict(shared_expert_ffn=0), "shared_expert_ffn (--shared-expert-ffn) 0 must be >= 1"),
    (
        dict(moe_every=0, ep=1, expert_bias=True),
        "expert_bias (--expert-bias) = True is a MoE "
        "routing option but the model has no MoE blocks: set moe_every (--moe-every, e.g. 2)",
    ),
]


@pytest.mark.parametrize("model_type", ["llama", "gpt"])
@pytest.mark.parametrize("bad,message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_bad_routing_is_one_clear_error(bad, message, model_type):
    cfg = TrainConfig.from_flags(
        **{**SMALL, **DP2_EP2, "experts": 8, "model_type": model_type, **bad}
    )
    with pytest.raises(ValueError) as err:
        cfg.check()
    assert message in str(err.value)


def test_routing_flags_are_refused_before_any_rank(capsys, monkeypatch):
    forbid_ranks(monkeypatch)
    argv = ["--tp", "1", "--pp", "1", "--dp", "2", "--ep", "2", "--experts", "8"]
    assert main([*argv, "--router-group-topk", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: router_group_topk (--router-group-topk) 2 needs router_groups")
    assert len(err.splitlines()) == 1


def test_routing_flags_do_not_apply_with_hf_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "vocab_size": 64}')
    cfg = TrainConfig.from_flags(
        **with_hf_config({**SMALL, "tp": 1, "pp": 1, "dp": 1, "ep": 1, "expert_bias": True}, path)
    )
    with pytest.raises(ValueError, match="--expert-bias does not apply with --hf-config"):
        cfg.check()


# -- the bias update ---------------------------------------------------------------------------
def test_the_bias_moves_after_a_step_and_not_after_a_skipped_one():
    cfg = TrainConfig.from_flags(**{**SMALL, **DP2_EP2, **LLAMA, **DEEPSEEK})
    parts = build(cfg, None, torch.device("cpu"))
    assert len(parts.bias_routers) == cfg.model.layers
    ids = torch.randint(0, 256, (4, 32))
    parts.module(ids)
    routers = parts.bias_routers
    counts = [r.tokens_per_expert.clone() for r in routers]
    assert all(int(c.sum()) == 4 * 32 * cfg.model.top_k for c in counts)
    parts.update_expert_bias(torch.tensor(True), None)  # skipped: no move, counts reset
    assert all(not r.expert_bias.any() and not r.tokens_per_expert.any() for r in routers)
    parts.module(ids)
    parts.update_expert_bias(torch.tensor(False), None)
    for r, c in zip(routers, counts, strict=True):
        want = torch.sign(c.float().mean() - c.float()) * cfg.model.moe_router.bias_update_rate
        torch.testing.assert_close(r.expert_bias, want, rtol=0, atol=0)
        assert not r.tokens_per_expert.any()
    with torch.no_grad():  # evaluation counts nothing
        parts.module(ids)
    assert all(not r.tokens_per_expert.any() for r in routers)


def test_a_skipped_fp16_step_moves_no_bias():
    """fp16 with a loss scale that overflows: the first step is skipped (its bias stays 0),
    the scaler backs off and a later step moves it."""
    base = {**SMALL, **DP2_EP2, **LLAMA, **DEEPSEEK, "precision": "fp16"}
    skipped = reference(TrainConfig.from_flags(**{**base, "steps": 1, "loss_scale": 3e38})).params
    assert all(not v.any() for k, v in skipped.items() if k.endswith("expert_bias"))
    moved = reference(TrainConfig.from_flags(**{**base, "steps": 1, "loss_scale": 1024.0})).params
    biases = [v for k, v in moved.items() if k.endswith("expert_bias")]
    assert len(biases) == SMALL["layers"] and all(v.any() for v in biases)


def test_verify_fp16_with_skipped_steps():
    """fp16 from loss scale 2^18: the first steps overflow and are skipped, later ones are
    taken (which ones depends on rounding: a gradient near fp16's largest value overflows on one
    CPU and not another); verify checks that the trainer skips exactly the reference's steps,
    and each bias moved at most once per taken step."""
    cfg = TrainConfig.from_flags(
        **{
            **SMALL,
            **DP2_EP2,
            **LLAMA,
            **DEEPSEEK,
            "precision": "fp16",
            "loss_scale": 2.0**18,
            "steps": 6,
            "zero": 1,
        }
    )
    ok, text = compare(cfg)
    assert ok, text
    run = reference(cfg)
    assert run.skipped[0] and not all(run.skipped), run.skipped
    assert all(s == (not math.isfinite(n)) for s, n in zip(run.skipped, run.norms, strict=True))
    taken = run.skipped.count(False)
    for name, bias in run.params.items():
        if name.endswith("expert_bias"):
            assert (
                bias.any()
                and bias.abs().max() <= taken * cfg.model.moe_router.bias_update_rate + 1e-9
            ), name


# -- verify: DP2 x EP2, ZeRO-1 and ZeRO-2 ----------------------------------------------------------
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("model_type", ["llama", "gpt"])
def test_verify_deepseek_routing_at_dp2_ep2(zero, model_type):
    model = LLAMA if model_type == "llama" else {}
    cfg = TrainConfig.from_flags(**{**SMALL, **DP2_EP2, **model, **DEEPSEEK, "zero": zero})
    ok, text = compare(cfg)
    assert ok, text
    assert "AGREE" in text.splitlines()[-1]
    params = reference(cfg).params
    biases = {k: v for k, v in params.items() if k.endswith("expert_bias")}
    assert len(biases) == cfg.model.layers and all(v.any() for v in biases.values())  # they moved


def test_verify_compares_the_biases(monkeypatch):
    """The biases are part of verify's comparison: a reference whose biases are off by one
    disagrees, naming one."""
    import fastpar.verify

    cfg = TrainConfig.from_flags(**{**SMALL, **DP2_EP2, **LLAMA, **DEEPSEEK, "zero": 1})
    real = fastpar.verify.reference

    def shifted_biases(cfg, *args, **kwargs):
        run = real(cfg, *args, **kwargs)
        for k in run.params:
            if k.endswith("expert_bias"):
                run.params[k] = run.params[k] + 1.0
        return run

    monkeypatch.setattr(fastpar.verify, "reference", shifted_biases)
    ok, text = compare(cfg)
    assert not ok and "expert_bias" in text


# -- checkpoints keep the bias -----------------------------------------------------------------
def test_resume_keeps_the_expert_bias(tmp_path):
    base = {**SMALL, **DP2_EP2, **LLAMA, **DEEPSEEK, "zero": 1, "steps": 6}
    whole = str(tmp_path / "whole")
    full = launch(TrainConfig.from_flags(**{**base, "checkpoint_dir": whole}))
    ckpt = str(tmp_path / "ckpt")
    first = launch(
        TrainConfig.from_flags(**{**base, "steps": 4, "checkpoint_dir": ckpt, "save_every": 2})
    )
    mid = _biases(f"{ckpt}/step_000004", tmp_path / "mid.pt")
    assert len(mid) == base["layers"] and all(v.any() for v in mid.values())
    resumed = launch(TrainConfig.from_flags(**{**base, "checkpoint_dir": ckpt, "resume": True}))
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in first] == [r["loss"] for r in full[:4]]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:]]
    want = _biases(f"{whole}/step_000006", tmp_path / "want.pt")
    got = _biases(f"{ckpt}/step_000006", tmp_path / "got.pt")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert any(not torch.equal(mid[n], want[n]) for n in want)  # steps 5-6 moved them on
