"""The recipes of docs/contributing.md, done: a new router score, a new Hugging Face family, a
new tensor-parallel style, a new pipeline schedule, a new flag and a new native model, each
added by the recipe's steps only (an entry in its registry, here monkeypatched; a flag's
field), then accepted by every place that reads the registry (the field) and computing what
it should."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from _mesh import make_mesh
from _pipeline import batch, blocks, check_step, dense_name, dense_references, loss_fn

from fastpar import families, parallelize
from fastpar.export import hf_mapping
from fastpar.models import LlamaConfig, build_llama, build_model, hf_documents, llama_hf, native
from fastpar.moe import SCORES, MoE
from fastpar.moe.balance import balance_scores
from fastpar.moe.config import Score
from fastpar.nn import RowParallelLinear, styles
from fastpar.nn.plans import builtin_plan
from fastpar.nn.styles import Style
from fastpar.parallel.pipeline import PipelineEngine, build_stage
from fastpar.parallel.pipeline.__main__ import main as pipeline_main
from fastpar.parallel.pipeline.hf import hf_decoder_blocks
from fastpar.parallel.pipeline.schedules import SCHEDULES, Schedule, make_schedule
from fastpar.testing import check_parallel, run_ranks
from fastpar.train import TrainConfig, build_parser, config_from, memory
from fastpar.train.optimizers import check_per_head
from fastpar.verify import main as verify_main

ONE_RANK = dict(tp=1, pp=1, dp=1, ep=1, steps=1, batch_size=4, microbatches=1, quiet=True)


# -- a new router score: its entry in SCORES ---------------------------------------------------
def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits).sqrt()


def _sum_to_one(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def test_new_router_score(monkeypatch):
    name = "sqrt_softplus"
    assert name not in SCORES
    monkeypatch.setitem(SCORES, name, Score(_sqrt_softplus, _sum_to_one))

    # the layer routes by it: the scores, the choice and the combine weights by hand
    torch.manual_seed(0)
    h, e, k, t = 16, 6, 2, 20
    moe = MoE(h, 32, e, k, score=name, capacity_factor=None)
    x = torch.randn(t, h)
    routing = moe.router(x)
    logits = x.double() @ moe.router.weight.detach().double().t()
    scores = torch.sqrt(torch.log1p(torch.exp(logits)))  # softplus, written out
    torch.testing.assert_close(routing.router_probs.double(), scores, rtol=1e-5, atol=1e-6)
    ids = scores.topk(k, dim=-1).indices
    assert torch.equal(routing.expert_ids.sort(-1).values, ids.sort(-1).values)
    chosen = scores.gather(1, routing.expert_ids)
    slots = torch.zeros(t, k, dtype=torch.long)  # dropless: every choice kept
    weights = moe.router.combine_weights(routing, slots)
    torch.testing.assert_close(weights.double(), chosen / chosen.sum(-1, keepdim=True))
    # the balancing losses average its own distribution
    p = balance_scores(routing.router_probs, name).double()
    torch.testing.assert_close(p, scores / scores.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    moe(x.unsqueeze(0)).square().mean().backward()  # the balancing loss joins in backward
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0

    # the command line lists it and takes it; TrainConfig.check and the models accept it
    parser = build_parser()
    assert "{softmax,sigmoid,sqrt_softplus}" in parser.format_help()
    for model in ("gpt", "llama"):
        argv = ["--model", model, "--moe-every", "1", "--router-score", name]
        cfg = config_from(parser.parse_args(argv))
        assert cfg.model.moe_router.score == name
        cfg = TrainConfig.from_flags(
            **{**ONE_RANK, "model_type": model, "moe_every": 1}, router_score=name
        )
        cfg.check()
        assert cfg.model.moe_router.score == name

    # a name not registered is refused, by the layer and by the run's checks
    with pytest.raises(ValueError, match=r"score must be one of .*'sqrt_softplus'.*got 'cube'"):
        MoE(h, 32, e, k, score="cube")
    with pytest.raises(ValueError, match="cube"):
        TrainConfig.from_flags(**ONE_RANK, moe_every=1, router_score="cube").check()


def test_new_router_score_is_not_exported(monkeypatch):
    """The export refuses a model routed by a new score: Hugging Face's MoE families route by
    a softmax, and the standalone code (fastpar/models/hf_code, which cannot import fastpar)
    knows softmax and sigmoid only."""
    pytest.importorskip("transformers")
    name = "sqrt_softplus"
    monkeypatch.setitem(SCORES, name, Score(_sqrt_softplus, _sum_to_one))
    gpt = TrainConfig.from_flags(**ONE_RANK, moe_every=1, router_score=name)
    mapping, model_class = hf_mapping(gpt)
    with pytest.raises(ValueError, match="--router-score sqrt_softplus: the exported model's code"):
        mapping.hf_config(gpt.model)  # what the export writes, refused before any file
    with pytest.raises(ValueError, match="router_score must be 'softmax' or 'sigmoid'"):
        model_class.config_class(router_score=name)  # the standalone code's own guard
    llama = TrainConfig.from_flags(**ONE_RANK, model_type="llama", moe_every=1, router_score=name)
    with pytest.raises(ValueError, match="has no HF export"):
        llama_hf.hf_model_type(llama.model)


# -- a new pipeline schedule: a Schedule subclass and its entry in SCHEDULES ----------------------
class LastInFirstOut(Schedule):
    """GPipe with the backwards in reverse: all forwards, then the backwards of the last
    micro-batch first (its activations are the freshest)."""

    name: ClassVar[str] = "gpipe-lifo"
    forwards_first: ClassVar[bool] = True
    refuses: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"zero3": "a made-up refusal for the recipe's test"}
    )

    def steps(self, num_stages: int, stage: int) -> list:
        m = self.num_microbatches
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def _schedule_step(names: tuple[str, ...], m: int, refs) -> None:
    """Two SGD steps of the blocks pipelined with each schedule of ``names`` (made from
    ``SCHEDULES``), each checked against the unpipelined model."""
    mesh = make_mesh(pp="world")
    for name in names:
        stage, (lo, _) = build_stage(blocks(), mesh.pp_size, mesh.pp_rank)
        sched = make_schedule(name, m)
        engine = PipelineEngine(stage, mesh, sched, loss_fn=loss_fn)
        opt = torch.optim.SGD(stage.parameters(), lr=0.5)
        for step in range(2):
            x, y = batch(step)
            opt.zero_grad()
            loss = engine.train_step(
                x if mesh.is_first_stage else None, y if mesh.is_last_stage else None
            )
            grads = [(dense_name(n, lo), p.grad) for n, p in stage.named_parameters()]
            check_step(refs, step, loss, grads, f"{name}, stage {mesh.pp_rank}, step {step + 1}: ")
            opt.step()
        assert engine.stats["max_in_flight"] == sched.max_in_flight(mesh.pp_size, mesh.pp_rank)


def test_new_schedule(monkeypatch, capsys):
    name = LastInFirstOut.name
    assert name not in SCHEDULES
    monkeypatch.setitem(SCHEDULES, name, LastInFirstOut)

    # the command line lists it and takes it
    parser = build_parser()
    assert "{gpipe,1f1b,interleaved,zb-h1,gpipe-lifo}" in parser.format_help()
    pp2 = dict(ONE_RANK, pp=2, batch_size=8, microbatches=4, moe_every=0)
    argv = ["--schedule", name, "--pp", "2", "--microbatches", "4", "--batch-size", "8"]
    assert config_from(parser.parse_args(argv)).schedule == name
    TrainConfig.from_flags(**pp2, schedule=name).check()
    # TrainConfig.check asks what it declares it refuses, and names its reason
    with pytest.raises(ValueError, match=r"gpipe-lifo with --zero 3 .*a made-up refusal"):
        TrainConfig.from_flags(
            **{**pp2, "dp": 2, "batch_size": 16, "zero": 3}, schedule=name
        ).check()
    with pytest.raises(ValueError, match=r"schedule must be one of .*gpipe-lifo"):
        TrainConfig.from_flags(**pp2, schedule="gpipe-fifo").check()

    # its activation memory: every forward is held until the backwards start, as GPipe's
    m = pp2["microbatches"]
    sched = make_schedule(name, m)
    assert [sched.held(2, s) for s in range(2)] == [m, m]
    lifo = memory.stage_bytes(TrainConfig.from_flags(**pp2, schedule=name))
    one_f_one_b = memory.stage_bytes(TrainConfig.from_flags(**pp2, schedule="1f1b"))
    # 1F1B holds p - s micro-batches on stage s (and, without --fused-ce, nothing fixed)
    per_microbatch = [b / h for b, h in zip(one_f_one_b, (2, 1), strict=True)]
    assert lifo == [int(m * b) for b in per_microbatch]

    # python -m fastpar.parallel.pipeline draws it: 4 forwards, then B3 first
    pipeline_main(["--schedule", name, "--stages", "2", "--microbatches", "4"])
    drawn = capsys.readouterr().out
    assert "LastInFirstOut, 4 micro-batches, 2 stages" in drawn
    assert drawn.index("B3") < drawn.index("B0")

    # a real pipelined step on 2 ranks: the unpipelined model's loss and gradients (judged by
    # the tolerance rule, fastpar.tolerance), as 1F1B's are in the same run
    run_ranks(_schedule_step, 2, (name, "1f1b"), m, dense_references())


# -- a new Hugging Face family: its Family record (a known architecture under a new model_type) --
NEW_FAMILY = "my_qwen3"


@functools.cache
def _new_config_class():
    """Qwen3's config class under a new model_type (what a fork of Qwen3 would ship)."""
    import transformers

    return type("MyQwen3Config", (transformers.Qwen3Config,), {"model_type": NEW_FAMILY})


def _tiny_decoder() -> dict:
    """The tests' small decoder (tests/_hf.py), dropout off."""
    from _hf import DECODER

    return dict(DECODER, attention_dropout=0.0)


def _new_family_model():
    import transformers

    cfg = _new_config_class()(**_tiny_decoder())
    cfg._attn_implementation = "eager"
    return transformers.Qwen3ForCausalLM(cfg)


def test_new_hf_family(monkeypatch):
    pytest.importorskip("transformers")
    model = _new_family_model()
    with pytest.raises(ValueError, match="no built-in plan"):  # not registered yet
        parallelize(model)
    # the recipe's step 1: a record, here Qwen3's under the new name; no Llama conversion
    record = dataclasses.replace(families.get("qwen3"), model_type=NEW_FAMILY, llama_arch=None)
    monkeypatch.setitem(families.REGISTRY, NEW_FAMILY, record)

    # the pipeline helper splits it by layer (its layer_types masks): the same logits
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    seq = torch.nn.Sequential(*hf_decoder_blocks(model))
    assert len(seq) == 2 + 2 and torch.equal(seq(ids), model(ids, use_cache=False).logits)
    assert hf_documents.unsupported(model.config) is None  # packed documents take it
    with pytest.raises(ValueError, match="is not one of"):  # llama_arch=None: not converted
        llama_hf.from_hf(model.state_dict(), model.config.to_dict())

    # planned by parallelize with its built-in plan and trained at TP 2: logits, loss, every
    # gradient on every rank and the weights after 2 AdamW steps are the single-process
    # model's under the tolerance rule (fastpar.tolerance); q_norm / k_norm found per head
    report = check_parallel(_new_family_model, tp=2, dp=1, zero=0, steps=2, rows=2, seq=8)
    assert report.ok, report.text
    assert sorted(report.grad_reduced) == sorted(
        f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in ("q_norm", "k_norm")
    )


# -- a new tensor-parallel style: its Style record in STYLES ------------------------------------
def _row_whole_input(module, tp_group, mesh, **options):
    return RowParallelLinear.from_dense(module, group=tp_group, input_is_parallel=False, **options)


WHOLE_INPUT_ROW = Style(
    "row_whole_input", styles.get("row").check, swap=_row_whole_input, layer=True
)
"""A linear fed a whole activation, split by its input features: each rank takes its slice of
the input, the partial products are all-reduced (its output is whole)."""


def _llama_model():
    import transformers

    cfg = transformers.LlamaConfig(**_tiny_decoder())
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


def test_new_tp_style(monkeypatch):
    pytest.importorskip("transformers")
    name = WHOLE_INPUT_ROW.name
    with pytest.raises(ValueError, match=r"style must be one of \['column', .*'experts'\]"):
        parallelize(_llama_model(), {"lm_head": name})  # not registered yet
    monkeypatch.setitem(styles.STYLES, name, WHOLE_INPUT_ROW)

    # the LM head split by its hidden features instead of the vocabulary: at TP 2 the same
    # logits, loss, gradients and trained weights as the single-process model
    plan = {**builtin_plan(_llama_model()), "lm_head": name}
    report = check_parallel(_llama_model, plan, tp=2, dp=1, zero=0, steps=2, rows=2, seq=8)
    assert report.ok, report.text

    # an unregistered name is refused, naming the known ones (the new one among them)
    with pytest.raises(ValueError, match=r"style must be one of .*'row_whole_input'\]"):
        parallelize(_llama_model(), {"lm_head": "row_whole_inputs"})


# -- a new native model: its NativeModel record ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Qwen2ishConfig(LlamaConfig):
    attention_bias: bool = True  # (not among its flags: always on)


QWEN2ISH = native.NativeModel(
    name="qwen2ish",
    label="Qwen2-ish",
    config=Qwen2ishConfig,
    build=build_llama,
    flags=("kv_heads", "rope_theta"),
    moe_every=0,
    per_head_muon=False,
)
"""Fastpar's Llama with q/k/v biases always on (Qwen2's attention), taking --kv-heads and
--rope-theta, no MoE blocks unless asked, Muon over whole matrices only; it does not export."""


def test_new_native_model(monkeypatch, capsys):
    from _flags import tiny_argv, tiny_config

    name = QWEN2ISH.name
    with pytest.raises(ValueError, match="--model must be gpt, llama or deepseek, got 'qwen2ish'"):
        TrainConfig.from_flags(**tiny_config(model_type=name)).check()
    monkeypatch.setitem(native.REGISTRY, name, QWEN2ISH)  # the recipe's one step

    # the command line lists it and takes it; its config is its record's
    parser = build_parser()
    assert "{gpt,llama,deepseek,qwen2ish}" in parser.format_help()
    cfg = config_from(parser.parse_args(["--model", name, "--kv-heads", "2"]))
    model = cfg.model
    assert isinstance(model, LlamaConfig) and model.attention_bias and model.kv_heads == 2
    assert cfg.model.moe_every == 0  # its default
    blocks = build_model(TrainConfig.from_flags(**tiny_config(model_type=name)).model)  # 2 blocks
    assert [n for b in blocks for n, _ in b.named_parameters() if "bias" in n] == [
        "attn.qkv.bias"
    ] * 2
    # its flags are its own: another model's is refused naming who takes it, and its own
    # flags on a model that does not take them name it beside the Llama
    with pytest.raises(ValueError, match=r"--qk-norm is a Llama option: add --model llama$"):
        TrainConfig.from_flags(**tiny_config(model_type=name, qk_norm=True)).check()
    with pytest.raises(
        ValueError, match="--kv-heads is a Llama and Qwen2-ish option: add --model llama or "
    ):
        TrainConfig.from_flags(**tiny_config(kv_heads=2)).check()
    with pytest.raises(ValueError, match="--norm layernorm is a GPT option: the Qwen2-ish uses"):
        TrainConfig.from_flags(**tiny_config(model_type=name, norm="layernorm")).check()
    with pytest.raises(ValueError, match="--muon-per-head with --optimizer muon"):
        check_per_head(
            TrainConfig.from_flags(
                **tiny_config(model_type=name, optimizer="muon", muon_per_head=True)
            )
        )
    with pytest.raises(ValueError, match="--model qwen2ish does not export"):
        hf_mapping(cfg)
    assert memory.stage_bytes(TrainConfig.from_flags(**tiny_config(ONE_RANK, model_type=name)))

    # trained at tp 2 x dp 2 with ZeRO-1, proven by fastpar.verify against one process: the
    # losses, every gradient and the weights after 2 steps under the tolerance rule
    argv = tiny_argv(model_type=name, kv_heads=2, tp=2, dp=2, pp=1, ep=1, zero=1)
    assert verify_main(argv) == 0, capsys.readouterr().out
    assert "AGREE" in capsys.readouterr().out


# -- a new flag: a field of TrainOptions, its bound declared on it ----------------------------
def test_new_flag(monkeypatch):
    from fastpar.cliutil import option
    from fastpar.train import cli, config
    from fastpar.train.options import TRAINING

    @dataclasses.dataclass
    class Config(TrainConfig):  # TrainOptions with one more field, as the recipe's step 1
        ema_every: int = option(
            0, TRAINING, "average the weights every N steps", at_least=0, note="0: off"
        )

    monkeypatch.setattr(config, "TrainConfig", Config)
    parser = cli.build_parser()
    (section,) = [g for g in parser._action_groups if g.title == TRAINING]
    (action,) = [a for a in section._group_actions if "--ema-every" in a.option_strings]
    assert action.help == "average the weights every N steps (default %(default)s)"
    assert parser.parse_args(["--ema-every", "3"]).ema_every == 3
    assert parser.parse_args([]).ema_every == 0
    Config.from_flags(**ONE_RANK, ema_every=0).check()  # its least value
    with pytest.raises(ValueError, match=r"^--ema-every -1 must be >= 0 \(0: off\)$"):
        Config.from_flags(**ONE_RANK, ema_every=-1).check()
