"""Each option declared once: the router and expert options are ``RouterConfig`` /
``ExpertConfig`` fields (``fastpar.moe.config``), the training command's flags are derived from
the fields' metadata, the router scores live in one registry (``SCORES``) and an unknown score
name is an error everywhere (the layer, the models, ``TrainConfig.check``, the command)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields

import pytest
import torch
from _flags import tiny_argv
from _no_ranks import forbid_ranks

from fastpar.cliutil import flat_name, option, option_of
from fastpar.models import GPTConfig, LlamaConfig, build_llama, native
from fastpar.models.llama import routing, routing_options
from fastpar.moe import MoE, TopKRouter
from fastpar.moe.balance import balance_scores
from fastpar.moe.config import ROUTING, ROUTING_DEFAULTS, SCORES, ExpertConfig, RouterConfig, Score
from fastpar.train import TrainConfig, build_parser, config_from, main
from fastpar.train.checkpointing import compare_settings, write_config_file
from fastpar.train.checks import flag
from fastpar.train.cli import read_config_file
from fastpar.train.config import flag_specs
from fastpar.train.options import GROUPS

#: MoE blocks (the routing flags apply), dp 2 x ep 2
SMALL = tiny_argv(tp=1, pp=1, dp=2, ep=2, steps=1)
#: every key the train_config.json of the code before this change held (its TrainConfig fields)
_SAVED = """allow_fresh allow_other_run allow_schedule_change attention_bias aux_loss
aux_loss_coef batch_size bias_update_rate capacity_factor checkpoint_dir collective_timeout
compile cp cp_attention data data_dtype debug_checks dp eos_id ep eval_batches eval_every
eval_split expert_bias experts ffn fused_ce head_dim heads hf_config hidden init_from_hf
keep_last kv_heads layers log_every loss_normalization loss_scale lr lr_schedule max_grad_norm
max_skipped_steps metrics_file microbatch_group_size microbatches min_lr model_type moe_every
moe_expert_tp moe_ffn norm overlap_chunks pack peak_tflops plan pp precision profile
profile_steps qk_norm quiet recompute reset_positions resume rope_theta routed_scaling_factor
router_group_topk router_groups router_score save_every schedule seed seq_len
sequence_parallel shared_expert_ffn shared_expert_gate steps tensorboard tokenizer top_k tp
untied virtual_stages vocab_size warmup weight_decay z_loss_coef zero"""
SAVED_KEYS = _SAVED.split()
ROUTING_FLAGS = [
    "--router-score",
    "--routed-scaling-factor",
    "--router-groups",
    "--router-group-topk",
    "--expert-bias",
    "--bias-update-rate",
    "--aux-loss",
    "--aux-loss-coef",
    "--z-loss-coef",
    "--shared-expert-ffn",
    "--shared-expert-gate",
]


def _flags(ap) -> dict[str, object]:
    """{flag: its action} of a parser, the --no-X halves and -h / --config left out."""
    out = {}
    for action in ap._actions:
        for s in action.option_strings:
            if s.startswith("--") and s not in ("--config", "--help") and not s.startswith("--no-"):
                out[s] = action
    return out


def _section(ap, title: str) -> set[str]:
    (group,) = [g for g in ap._action_groups if g.title == title]
    return {s for a in group._group_actions for s in a.option_strings if not s.startswith("--no-")}


# -- one registry of scores; an unknown name is an error ----------------------------------------
def test_an_unknown_score_is_an_error_in_the_layer():
    with pytest.raises(
        ValueError, match=r"score must be one of \('softmax', 'sigmoid'\), got 'relu'"
    ):
        MoE(8, 16, 4, score="relu")
    with pytest.raises(ValueError, match="got 'relu'"):
        RouterConfig(score="relu")
    with pytest.raises(ValueError, match="got 'relu'"):
        TopKRouter(8, 4, score="relu")
    # the balancing losses once took any name but softmax for sigmoid
    with pytest.raises(ValueError, match="got 'relu'"):
        balance_scores(torch.rand(3, 4), "relu")


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_an_unknown_score_is_an_error_in_train_config(model_type):
    cfg = TrainConfig.from_flags(
        tp=1, pp=1, dp=2, ep=2, moe_every=1, model_type=model_type, router_score="relu"
    )
    with pytest.raises(ValueError) as err:
        cfg.check()
    assert "router_score (--router-score) 'relu' must be one of ('softmax', 'sigmoid')" in str(
        err.value
    )
    with pytest.raises(ValueError, match=r"must be one of .* got 'relu'"):
        LlamaConfig(moe_every=1, moe_router=RouterConfig(score="relu")).check()


def test_an_unknown_score_is_an_error_on_the_command_line(capsys, monkeypatch):
    forbid_ranks(monkeypatch)
    assert main([*SMALL, "--router-score", "relu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: router_score (--router-score) 'relu' must be one of")


def test_a_score_added_to_the_registry_routes(monkeypatch):
    """The router computes whatever score the registry names (no branch per name), and the
    models accept the new name."""
    monkeypatch.setitem(SCORES, "half", Score(lambda z: torch.sigmoid(z) / 2, lambda p: p))
    torch.manual_seed(0)
    r = TopKRouter(6, 4, top_k=1, score="half", capacity_factor=None)
    x = torch.randn(5, 6)
    want = torch.sigmoid(x @ r.weight.detach().t()) / 2
    torch.testing.assert_close(r(x).router_probs, want)
    half = RouterConfig(score="half")
    LlamaConfig(moe_every=1, moe_router=half).check()
    assert routing_options(GPTConfig(moe_every=1, moe_router=half))["router"].score == "half"
    TrainConfig.from_flags(tp=1, pp=1, dp=2, ep=2, moe_every=1, router_score="half").check()
    assert _flags(build_parser())["--router-score"].metavar == "{softmax,sigmoid,half}"


def test_the_flag_words_are_the_registry():
    flags = _flags(build_parser())
    assert flags["--router-score"].metavar == "{" + ",".join(SCORES) + "}"
    from fastpar.parallel.pipeline.schedules import SCHEDULES
    from fastpar.train.checks import LR_SCHEDULES

    assert flags["--schedule"].metavar == "{" + ",".join(SCHEDULES) + "}"
    assert flags["--lr-schedule"].metavar == "{" + ",".join(LR_SCHEDULES) + "}"


# -- the flags are the fields ----------------------------------------------------------------
def test_every_field_has_help_and_a_group():
    for spec in flag_specs():
        opt = spec.option
        assert opt.text().strip() and opt.group in GROUPS, spec.name


def test_the_flags_are_the_fields():
    ap = build_parser()
    assert set(_flags(ap)) == {flag(spec.name) for spec in flag_specs()}
    routing = {
        flag(flat_name(f))
        for c in (RouterConfig, ExpertConfig)
        for f in fields(c)
        if option_of(f) is not None
    }
    assert routing == set(ROUTING_FLAGS) == _section(ap, ROUTING)
    assert set(ROUTING_DEFAULTS) == {f[2:].replace("-", "_") for f in ROUTING_FLAGS}
    for spec in flag_specs():  # each flag's help is its field's, in its field's section
        opt, action = spec.option, _flags(ap)[flag(spec.name)]
        assert action.help.startswith(opt.text().replace("%", "%%")), spec.name
        assert flag(spec.name) in _section(ap, opt.group), spec.name


def test_a_new_router_field_becomes_a_flag():
    """A field declared with ``option`` on the RouterConfig a model config holds is a flag of
    the command, under its flat name, in the routing section; its words are checked."""

    @dataclass(frozen=True)
    class Router(RouterConfig):
        knob: float = option(0.5, ROUTING, "a new routing knob", name="router_knob")
        kind: str = option("a", ROUTING, "a new routing word", words=("a", "b"), name="router_kind")

    @dataclass(frozen=True)
    class KnobGPT(GPTConfig):
        moe_router: Router = field(default_factory=Router)

    gpt = native.get("gpt")
    native.register(dataclasses.replace(gpt, name="knob", config=KnobGPT))
    try:
        ap = build_parser()
        assert "--router-knob" in _section(ap, ROUTING)
        assert _flags(ap)["--router-knob"].help == "a new routing knob (default %(default)s)"
        assert ap.parse_args(["--router-knob", "0.25"]).router_knob == 0.25
        assert ap.parse_args([]).router_knob == 0.5
        assert {s.name: s.hint for s in flag_specs()}["router_knob"] is float
        assert _flags(ap)["--router-kind"].metavar == "{a,b}"
        from fastpar.train.config_checks import check_words

        cfg = TrainConfig.from_flags(model_type="knob", router_knob=0.25, router_kind="b")
        assert cfg.model.moe_router.knob == 0.25 and cfg.flags()["router_kind"] == "b"
        check_words(cfg)
        with pytest.raises(ValueError, match="--router-kind 'c' must be one of a, b"):
            check_words(TrainConfig.from_flags(model_type="knob", router_kind="c"))
    finally:
        native.unregister("knob")


def test_model_configs_hold_the_routing_fields():
    for config in (GPTConfig, LlamaConfig):
        assert routing(config()) == ROUTING_DEFAULTS, config
    cfg = LlamaConfig(
        moe_every=1,
        moe_router=RouterConfig(
            score="sigmoid",
            scaling_factor=2.0,
            num_groups=2,
            group_topk=1,
            expert_bias=True,
            aux_loss="none",
            z_loss_coef=0.1,
        ),
        moe_experts=ExpertConfig(shared_ffn_hidden_size=8, shared_gate=True),
    )
    opts = routing_options(cfg)
    # the nested configs: the flat fields, the model's capacity (dropless) and top-k
    # normalisation, and its SwiGLU experts -- what its MoE layers are built with
    assert (
        opts["router"]
        == cfg.moe_router
        == RouterConfig(
            score="sigmoid",
            scaling_factor=2.0,
            num_groups=2,
            group_topk=1,
            expert_bias=True,
            aux_loss=None,
            z_loss_coef=0.1,
            capacity_factor=None,
            normalize_topk=True,
        )
    )
    want = ExpertConfig(expert="swiglu", shared_ffn_hidden_size=8, shared_gate=True)
    assert opts["experts"] == cfg.moe_experts == want
    layer = build_llama(cfg)[1].mlp
    assert (layer.router.config, layer.expert_config) == (cfg.moe_router, want)
    run = TrainConfig.from_flags(
        model_type="llama", moe_every=1, router_score="sigmoid", expert_bias=True
    )
    assert run.model.moe_router.expert_bias and run.model.moe_experts.expert == "swiglu"


# -- the layer takes the configs ----------------------------------------------------------------
def test_moe_takes_the_configs_or_their_fields_alike():
    kw = dict(
        score="sigmoid",
        expert_bias=True,
        num_groups=2,
        group_topk=1,
        capacity_factor=None,
        expert="glu",
        shared_ffn_hidden_size=8,
        shared_gate=True,
    )
    torch.manual_seed(3)
    flat = MoE(8, 12, 4, 2, **kw)
    torch.manual_seed(3)
    router = RouterConfig(
        score="sigmoid", expert_bias=True, num_groups=2, group_topk=1, capacity_factor=None
    )
    experts = ExpertConfig(expert="glu", shared_ffn_hidden_size=8, shared_gate=True)
    nested = MoE(8, 12, 4, 2, router=router, experts=experts)
    a, b = flat.state_dict(), nested.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert nested.router.config == router and nested.expert_config == experts
    # keywords replace the configs' fields
    assert MoE(8, 12, 4, router=router, score="softmax").router.score == "softmax"
    with pytest.raises(TypeError, match="unexpected MoE option 'scor'"):
        MoE(8, 12, 4, scor="sigmoid")


def test_the_configs_refuse_what_the_layer_refused():
    with pytest.raises(ValueError, match="shared_gate=True needs shared experts"):
        ExpertConfig(shared_gate=True)
    with pytest.raises(ValueError, match="aux_loss must be one of"):
        RouterConfig(aux_loss="global")
    with pytest.raises(ValueError, match="num_groups must divide num_experts=6"):
        RouterConfig(num_groups=4, group_topk=1).check(6, 2)
    assert RouterConfig(aux_loss="none").aux_loss is None  # the flag's word for off


# -- saved settings read as before --------------------------------------------------------------
def test_train_config_json_keeps_its_keys(tmp_path):
    assert set(SAVED_KEYS) <= {spec.name for spec in flag_specs()}
    argv = [
        *SMALL,
        "--moe-every",
        "1",
        "--experts",
        "4",
        "--router-score",
        "sigmoid",
        "--expert-bias",
        "--shared-expert-ffn",
        "8",
        "--aux-loss",
        "sequence",
    ]
    cfg = config_from(build_parser().parse_args(argv))
    path = str(tmp_path / "train_config.json")
    write_config_file(cfg, path)
    with open(path) as f:
        saved = json.load(f)
    assert set(SAVED_KEYS) <= set(saved)
    assert (saved["router_score"], saved["expert_bias"], saved["shared_expert_ffn"]) == (
        "sigmoid",
        True,
        8,
    )
    assert read_config_file(path) == cfg.flags()
    again = config_from(build_parser().parse_args(["--config", path]))
    assert again.flags() == cfg.flags() and again.model == cfg.model
    refused, warned = compare_settings({"config": saved}, again)
    assert refused == [] and warned == []
    other = config_from(build_parser().parse_args(["--config", path, "--router-score", "softmax"]))
    assert compare_settings({"config": saved}, other)[1] == ["--router-score sigmoid -> softmax"]


def test_a_config_file_in_the_old_keys_loads(tmp_path):
    """A --config file as the code before this change wrote its routing keys (the flat flag
    names, with dashes or underscores)."""
    path = tmp_path / "old.json"
    path.write_text(
        json.dumps(
            {
                "router_score": "sigmoid",
                "routed-scaling-factor": 2.5,
                "router_groups": 2,
                "router_group_topk": 1,
                "shared_expert_gate": True,
                "shared_expert_ffn": 8,
                "aux_loss": "none",
                "moe_every": 1,
            }
        )
    )
    cfg = config_from(build_parser().parse_args(["--config", str(path), *SMALL]))
    flags = cfg.flags()
    assert (flags["router_score"], flags["routed_scaling_factor"], flags["router_groups"]) == (
        "sigmoid",
        2.5,
        2,
    )
    assert (flags["shared_expert_gate"], flags["shared_expert_ffn"]) == (True, 8)
    cfg.check()
    router, experts = (routing_options(cfg.model)[k] for k in ("router", "experts"))
    assert (router.score, router.scaling_factor, router.aux_loss) == ("sigmoid", 2.5, None)
    assert experts.shared_gate and experts.shared_ffn_hidden_size == 8


def test_every_model_and_routing_flag_says_what_resuming_with_another_value_does():
    """A flag that changes the model or its routing declares ``resume="refuse"`` or "warn"
    (the lists checkpoints judge a resume by are read from it), so a new model flag cannot
    silently resume a checkpoint of another model. The exceptions, each judged elsewhere."""
    from fastpar.moe.config import ROUTING
    from fastpar.train.checkpointing import REFUSED, WARNED
    from fastpar.train.options import MODEL

    elsewhere = {
        "hf_config": "its content is compared key by key",
        "vocab_size": "the vocabulary itself is compared",
        "init_from_hf": "where the first weights come from, not what the model is",
        "plan": "a TP plan is a layout",
    }
    for spec in flag_specs():
        opt = spec.option
        if opt.group not in (MODEL, ROUTING) or spec.name in elsewhere:
            continue
        assert opt.resume in ("refuse", "warn"), f"--{spec.name} declares no resume"
        assert spec.name in (REFUSED if opt.resume == "refuse" else WARNED)
    assert not set(REFUSED) & set(WARNED)
    assert {"hidden", "expert_bias", "shared_expert_ffn"} <= set(REFUSED)
    assert {"seed", "router_score", "z_loss_coef"} <= set(WARNED)
