"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``: multi-head latent attention and
DeepSeekMoE) under fastpar's built-in plan: the heads split over TP (``q_b_proj`` or ``q_proj``
and ``kv_b_proj`` column, ``o_proj`` row), the low-rank down-projections and their norms whole,
the rope key ``k_rot`` (the last ``qk_rope_head_dim`` outputs of ``kv_a_proj_with_mqa``, read by
every local head) through the "shared_key" region, the first dense MLP split as SwiGLU, the MoE
blocks as ``HFMoEBlock`` (experts over TP and EP, the router's ``e_score_correction_bias`` as
fastpar's expert bias, the shared experts split like a dense MLP).

Against the unsplit HF model (fastpar.tolerance's rule, docs/tolerances.md: the fp32 run, its
one-ulp twin and the float64 run): logits, loss and every parameter's gradient on every rank
at TP 2 and 4, with ``q_lora_rank`` set and None (sharded gradients against their slice,
replicated ones equal across the TP group bit for bit); TP 2 x EP 2 with DDP training and the
HF round trip; with the rope key's region taken away the logits still agree but the gradients
do not (the known MLA bug: a check of the forward alone would pass); the pipeline split by
layer at PP 2 (and PP 2 x TP 2); ``--hf-config`` training at TP 2 x EP 2 equal to
single-process training; greedy generation at TP 2; the router's score bias (a buffer) read by
``--init-from-hf`` and kept by the checkpoint and its export.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from _flags import HF_RUN
from _hf import batch, build, dense_runs, exact, generate_at_tp2
from _hf import config as hf_config
from _mesh import make_mesh
from _moe_hf import check_saved_as_hf
from _parity import local_part, same_on_every_rank

from fastpar import parallelize
from fastpar.moe.hf_block import HFMoEBlock
from fastpar.nn import param_layout
from fastpar.nn.shared_key import SharedKeyLinear
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree, compare

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install fastpar[hf])")
pytest.importorskip("transformers.models.deepseek_v3")
FAMILY = "deepseek_v3"
NO_Q_LORA = dict(q_lora_rank=None, attention_bias=True)  # q_proj; biases on the projections


def _model(**overrides):
    """tests/_hf.py's DeepSeek-V3 with a nonzero router score bias (the same on every rank)."""
    model = build(FAMILY, **overrides)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, generator=g) * 0.3)
    return model


def _one_step(tp: int, overrides: dict, strict: bool = True) -> dict:
    """One forward and backward of the parallelized model against the dense runs. ``strict``:
    assert every comparison; else return which quantities disagree."""
    mesh = make_mesh(tp=tp)
    dense = _model(**overrides)
    # (the planted bug: parallelize's own backward check would refuse it first)
    par = parallelize(copy.deepcopy(dense), mesh=mesh, check=True if strict else "forward")
    keys = [m for m in par.modules() if isinstance(m, SharedKeyLinear)]
    assert len(keys) == dense.config.num_hidden_layers
    assert all(k.features == dense.config.qk_rope_head_dim for k in keys)
    assert any(isinstance(m, HFMoEBlock) for m in par.modules())
    ids, labels = batch(FAMILY, 0)
    n = reduction_length(dense, ids)
    runs = dense_runs(FAMILY, dense, ids, labels)
    out = par(input_ids=ids, labels=labels)
    out.loss.backward()
    bad, unequal = [], []

    def check(actual, pick, what, cut=lambda t: t):
        single, twin, exact64 = (cut(pick(run)) for run in runs)
        if strict:
            assert_agree(actual, [single, twin], exact64, length=n, what=what)
        elif not compare(actual, [single, twin], exact64, length=n, what=what).ok:
            bad.append(what)

    check(out.logits, lambda r: r[0], "logits")
    check(out.loss, lambda r: r[1], "loss")
    names = set()
    for name, p in par.named_parameters(remove_duplicate=False):
        assert p.grad is not None, f"{name} got no gradient"
        check(p.grad, lambda r, k=name: r[2][k], name, lambda t, p=p: local_part(t, p))
        layout = param_layout(p)
        if layout is None or layout.kind == "replicated":
            try:
                same_on_every_rank(p.grad, mesh.tp_group, name)
            except AssertionError:
                if strict:
                    raise
                unequal.append(name)
        names.add(name)
    assert names == set(runs[0][2]), "every HF parameter, under its own name"
    plan = par.fastpar_plan
    assert plan.probed and plan.grad_reduced == []  # the key's region is a layer, not a hook
    return {"bad": bad, "unequal": unequal, "rel": plan.output_rel_diff}


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("overrides", [{}, NO_Q_LORA], ids=["q_lora", "no_q_lora"])
def test_mla_and_moe_at_tp_equal_the_dense_model(tp, overrides):
    for result in run_ranks(_one_step, tp, tp, overrides):
        assert result["rel"] < 1e-5


def _without_the_key_region(tp: int, overrides: dict) -> dict:
    """The known MLA bug, on purpose: the rope key's region taken away (a plain replicated
    linear: its gradient summed over this rank's heads only)."""
    forward = SharedKeyLinear.forward
    SharedKeyLinear.forward = lambda self, x: F.linear(x, self.weight, self.bias)
    try:
        return _one_step(tp, overrides, strict=False)
    finally:
        SharedKeyLinear.forward = forward


@pytest.mark.parametrize("overrides", [{}, NO_Q_LORA], ids=["q_lora", "no_q_lora"])
def test_without_the_rope_key_region_the_gradients_are_wrong(overrides):
    """The forward check passes (parallelize's probe compares the logits only) and the logits
    agree; the rope key's producer and everything upstream get wrong gradients, and the
    replicated ones differ across TP ranks."""
    for result in run_ranks(_without_the_key_region, 2, 2, overrides):
        assert result["rel"] < 1e-5
        bad = result["bad"]
        assert "logits" not in bad and "loss" not in bad
        assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in bad
        assert "model.layers.0.input_layernorm.weight" in bad  # upstream of layer 1's key
        assert "model.embed_tokens.weight" in bad
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in result["unequal"]


@pytest.mark.slow  # (test_models_deepseek_hf.py: HF weights at TP 2 x EP 2 in the CPU tier)
def test_tp2_ep2_equals_the_dense_model_and_saves_as_hf(tmp_path):
    check_saved_as_hf(FAMILY, tmp_path)


def _pipelined(tp: int, schedule: str, refs):
    """tests/_pipeline_hf.py's pipelined run, parallelized (tp > 1) with the family's built-in
    plan instead of that module's Llama-shaped one."""
    from _pipeline_hf import pipelined

    return pipelined(FAMILY, "eager", tp, schedule, 2, refs, plan=None)


@pytest.mark.parametrize(
    "world, tp, schedule", [(2, 1, "1f1b"), pytest.param(4, 2, "gpipe", marks=pytest.mark.slow)]
)
def test_pipeline_split_by_layer_equals_unpipelined(world, tp, schedule):
    from _pipeline_hf import covers_every_parameter, hf_references

    refs = hf_references(FAMILY, "eager")
    names = run_ranks(_pipelined, world, tp, schedule, refs, timeout=240)
    covers_every_parameter(names, FAMILY, tie=False)


@pytest.mark.slow  # (tests/test_train_hf.py trains --hf-config --ep 2 in the CPU tier)
def test_hf_config_trains_at_tp2_ep2(tmp_path):
    from fastpar.train import TrainConfig
    from fastpar.verify import compare as verify

    path = tmp_path / "deepseek_v3.json"
    path.write_text(json.dumps(hf_config(FAMILY, vocab_size=300).to_dict()))
    layout = dict(tp=2, ep=2, dp=2, pp=1, zero=1)
    cfg = TrainConfig.from_flags(**{**HF_RUN, "steps": 3}, **layout, hf_config=str(path))
    ok, text = verify(cfg)
    assert ok, text
    assert text.startswith("hf:") and text.endswith("AGREE")


def _pretrained_bias(directory: str) -> list[float]:
    """A rank of TP 2: the --init-from-hf model of ``directory`` (built-in plan, blocks)
    filled by ``load_pretrained``; the largest difference of each router score bias from
    the directory's."""
    from fastpar.models.hf import hf_blocks, load_config, load_pretrained

    mesh = make_mesh(tp=2)
    parts = hf_blocks(load_config(f"{directory}/config.json"), mesh)
    stage = torch.nn.Sequential(*parts.blocks)
    load_pretrained(parts, stage, directory)
    want = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    got = {  # the blocks keep HF's names under the Sequential's index
        n.partition(".")[2]: b
        for n, b in stage.named_buffers()
        if n.endswith("e_score_correction_bias")
    }
    assert got and all(want[n].abs().max() > 0 for n in got)
    return [float((b - want[n]).abs().max()) for n, b in got.items()]


def test_init_from_hf_loads_the_router_score_bias(tmp_path):
    """The pretrained ``e_score_correction_bias`` (a buffer, not a parameter) is read into
    the converted router, not left at zero."""
    directory = str(tmp_path / "pretrained")
    _model(vocab_size=300).save_pretrained(directory)
    for diffs in run_ranks(_pretrained_bias, 2, directory):
        assert diffs == [0.0] * len(diffs)


def test_generate_with_local_heads_equals_the_dense_model():
    """Greedy decoding at TP 2: the latent KV cache holds every head's key (one compressed
    latent and one rope key), the split heads read it as the dense model's do."""
    got = run_ranks(generate_at_tp2, 2, FAMILY)
    assert got[0] == got[1]


def test_init_from_hf_training_exports_with_the_router_score_bias(tmp_path):
    """--init-from-hf at TP 2 x EP 2: the first loss is the pretrained HF model's (its score
    bias routing), the checkpoint keeps the bias beside the parameters, and the export is a
    directory HF loads with the pretrained bias (nothing trains it: HF's model has no update)."""
    from fastpar.export import main as export_main
    from fastpar.train import TrainConfig, batch_of, launch, load_data

    directory = str(tmp_path / "pretrained")
    _model(vocab_size=300).save_pretrained(directory)
    ckpt = str(tmp_path / "ckpt")
    layout = dict(tp=2, ep=2, dp=2, pp=1)
    cfg = TrainConfig.from_flags(
        **HF_RUN, **layout, pack="stream", init_from_hf=directory, checkpoint_dir=ckpt
    )
    records = launch(cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    x, y, _ = batch_of(cfg, load_data(cfg), 0)
    with torch.no_grad():
        single = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
        ref = F.cross_entropy(exact(hf)(input_ids=x).logits.flatten(0, 1), y.flatten())
    n = reduction_length(hf, x)
    assert_agree(records[0]["loss"], single, ref, length=n, what="step 1 loss")
    out = str(tmp_path / "hf_out")
    assert export_main([ckpt, out]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    biases = [k for k in tuned if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(tuned[k], hf.state_dict()[k]) for k in biases)
    assert not torch.equal(tuned["lm_head.weight"], hf.state_dict()["lm_head.weight"])
