"""The HF family registry (``fastpar.families``) and the TP style records (``fastpar.nn.styles``).

Every consumer lists the families it supports by asking the registry: the sets below are the
ones each consumer supported when it kept its own table. A family registered at run time (a
new model_type reusing Llama's record) is at once planned, split into pipeline blocks, trained
with packed documents and converted to fastpar's Llama; a new MoE block class is at once a
block the "experts" style takes. Unknown families and styles are errors naming the known ones.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch
from _hf import VOCAB, build, config
from _moe_hf import BLOCKS, H

from fastpar import ParallelMesh, families, parallelize
from fastpar.models import hf as models_hf
from fastpar.models import hf_documents, llama_hf
from fastpar.moe.hf import adapter_names, hf_family
from fastpar.nn import styles
from fastpar.nn.plan import parse_style
from fastpar.nn.plans import builtin_plan
from fastpar.nn.styles import is_hf_moe_block
from fastpar.parallel.pipeline.hf import hf_decoder_blocks
from fastpar.testing import run_ranks
from fastpar.train.cli import build_parser

PLANNED = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "gpt2",
    "bert",
}
SPLIT = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"}
DOCUMENTS = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gpt2"}
LLAMA_CONVERTS = {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"}
MOE_BLOCKS = {"mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"}
STYLES = ["column", "row", "vocab", "shared_key", "per_head", "replicate", "experts"]
FAKE = "fake_llama"


def test_the_registry_lists_what_every_consumer_supports():
    assert set(families.names("plan")) == PLANNED
    assert set(families.names("masks")) == SPLIT == set(models_hf.decoders())
    assert set(families.names("documents")) == DOCUMENTS == set(hf_documents.families())
    assert set(families.names("llama_arch")) == LLAMA_CONVERTS
    assert set(adapter_names()) == MOE_BLOCKS
    assert set(families.names()) == PLANNED | MOE_BLOCKS
    for family in PLANNED:
        model = build(family)
        assert builtin_plan(model) is not None, family
        assert models_hf.has_builtin_plan(model.config)
        if family in SPLIT:
            assert len(hf_decoder_blocks(model)) == model.config.num_hidden_layers + 2
        else:  # qwen2_moe: the decoder's shape, but not registered as split by layer
            why = "not a supported decoder family|cannot be split into pipeline blocks"
            with pytest.raises((ValueError, AttributeError), match=why):
                hf_decoder_blocks(model)
    for family in ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"):  # the experts' blocks
        blocks = [m for m in build(family).modules() if is_hf_moe_block(m)]
        assert blocks and {hf_family(b) for b in blocks} == {family}


@pytest.fixture
def fake_llama(monkeypatch):
    """Llama's record under a new model_type (undone after the test)."""
    record = dataclasses.replace(families.get("llama"), model_type=FAKE)
    monkeypatch.setitem(families.REGISTRY, FAKE, record)
    return record


def _fake_model(seed: int = 0):
    cfg = config("llama", tie_word_embeddings=False)
    cfg.model_type = FAKE
    torch.manual_seed(seed)
    import transformers

    return transformers.LlamaForCausalLM(cfg).float()


def test_an_unregistered_model_type_is_refused_everywhere():
    model = _fake_model()
    assert FAKE not in families.names()
    assert builtin_plan(model) is None
    assert not models_hf.has_builtin_plan(model.config)
    assert FAKE not in models_hf.decoders()
    with pytest.raises(ValueError, match="no built-in plan"):
        parallelize(model)
    with pytest.raises(ValueError, match="not a supported decoder family"):
        hf_decoder_blocks(model)
    assert "not supported" in hf_documents.unsupported(model.config)
    with pytest.raises(ValueError, match="is not one of"):
        llama_hf.from_hf(model.state_dict(), {**model.config.to_dict(), "model_type": FAKE})


def test_a_registered_family_is_seen_by_every_consumer(fake_llama):
    model = _fake_model()
    llama = build("llama")
    assert FAKE in families.names("plan")
    assert builtin_plan(model) == builtin_plan(llama)
    assert models_hf.has_builtin_plan(model.config)
    assert FAKE in models_hf.decoders()
    assert hf_documents.unsupported(model.config) is None
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    seq = torch.nn.Sequential(*hf_decoder_blocks(model))  # the pipeline split
    assert torch.equal(seq(ids), model(ids, use_cache=False).logits)
    hf_state = dict(model.state_dict())
    cfg, state = llama_hf.from_hf(hf_state, {**model.config.to_dict(), "model_type": FAKE})
    assert cfg.layers == model.config.num_hidden_layers and not cfg.qk_norm
    back = llama_hf.to_hf(state, cfg)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def _fake_tp() -> float:
    """A rank of TP 2: the fake family (registered in this process) parallelized with its
    built-in plan; the logits' largest difference from the dense model's, relative."""
    families.register(dataclasses.replace(families.get("llama"), model_type=FAKE))
    dense = _fake_model(seed=3)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    want = dense(ids, use_cache=False).logits
    par = parallelize(_fake_model(seed=3), mesh=ParallelMesh(tp=2))
    got = par(ids, use_cache=False).logits
    return float((got - want).abs().max() / want.abs().max())


def test_a_registered_family_parallelizes_with_its_plan():
    for rel in run_ranks(_fake_tp, 2):
        assert rel < 1e-5


def test_a_registered_moe_block_is_taken_by_the_experts_style(monkeypatch):
    class ToyMoeBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)

    block = ToyMoeBlock()
    assert not is_hf_moe_block(block)
    with pytest.raises(TypeError, match=r"needs a Hugging Face MoE block .*MixtralSparseMoeBlock"):
        styles.get("experts").check("mlp", block, "experts")
    with pytest.raises(ValueError, match="moe_from_hf supports the Hugging Face blocks"):
        hf_family(block)
    toy = families.Family("toy_moe", moe=families.MoEBlock("toy_moe", ("ToyMoeBlock",)))
    monkeypatch.setitem(families.REGISTRY, "toy_moe", toy)
    assert is_hf_moe_block(block) and hf_family(block) == "toy_moe"
    styles.get("experts").check("mlp", block, "experts")  # accepted now
    assert "toy_moe" in adapter_names()


def test_unknown_family_and_style_name_the_known_ones():
    with pytest.raises(ValueError, match="unknown model family 'nope'; registered: ") as err:
        families.get("nope")
    assert all(name in str(err.value) for name in PLANNED | MOE_BLOCKS)
    with pytest.raises(ValueError, match="unknown model family"):
        families.unregister("nope")
    with pytest.raises(ValueError, match="already registered"):
        families.register(families.get("llama"))
    with pytest.raises(ValueError, match="masks must be one of"):
        families.register(families.Family("x", masks="diagonal"))
    with pytest.raises(ValueError, match="supporting must be one of"):
        families.names("tp")
    assert list(styles.STYLES) == STYLES
    with pytest.raises(ValueError, match=r"style must be one of \['column', 'row', 'vocab'"):
        styles.get("colum")
    with pytest.raises(ValueError, match=r"plan\['lm_head'\] = 'colum': style must be one of"):
        parse_style("lm_head", "colum")
    with pytest.raises(ValueError, match="style must be one of"):
        parallelize(build("llama"), {"lm_head": "colum"})


def test_register_and_unregister(monkeypatch):
    monkeypatch.setattr(families, "REGISTRY", dict(families.REGISTRY))
    record = families.register(dataclasses.replace(families.get("gpt2"), model_type="gpt2_b"))
    assert "gpt2_b" in families.names("plan") and "gpt2_b" in hf_documents.families()
    assert families.unregister("gpt2_b") is record
    assert "gpt2_b" not in families.names()


def test_style_records():
    for name in ("per_head", "replicate"):
        assert not styles.get(name).options and styles.get(name).swap is None
        with pytest.raises(ValueError, match=f"style '{name}' takes no keyword arguments"):
            parse_style("x", (name, {"a": 1}))
    assert {n for n, s in styles.STYLES.items() if s.layer} == {
        "column",
        "row",
        "vocab",
        "shared_key",
    }
    column = styles.get("column")
    assert column.splits_output({}) and not column.splits_output({"gather_output": True})
    assert not styles.get("row").splits_output({})
    with pytest.raises(TypeError, match=r"needs an nn\.Linear or a Hugging Face Conv1D"):
        column.check("x", torch.nn.Embedding(3, 2), "column")
    with pytest.raises(TypeError, match=r"needs an nn\.Embedding"):
        styles.get("vocab").check("x", torch.nn.Linear(3, 2), "vocab")
    with pytest.raises(TypeError, match=r"'shared_key' needs an nn\.Linear at 'x'"):
        styles.get("shared_key").check("x", torch.nn.Embedding(3, 2), "shared_key")
    assert not styles.get("shared_key").splits_output({"features": 2})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_family_record_says_its_attention_to_the_llama_conversion(family, monkeypatch):
    """A new model_type with Qwen2's / Qwen3's record converts with q/k/v biases / q-k norms;
    the same model under a record that says neither leaves those tensors without a name."""
    import transformers

    record = families.get(family)
    assert (record.qkv_bias, record.qk_norm) == (family == "qwen2", family == "qwen3")
    cfg = config(family, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, record.llama_arch)(cfg).float()
    hf_state = dict(model.state_dict())
    for name, rec in ((FAKE, record), ("fake_plain", families.get("llama"))):
        monkeypatch.setitem(families.REGISTRY, name, dataclasses.replace(rec, model_type=name))
    c = {**model.config.to_dict(), "model_type": FAKE}
    ours, state = llama_hf.from_hf(hf_state, c)
    assert (ours.attention_bias, ours.qk_norm) == (record.qkv_bias, record.qk_norm)
    back = llama_hf.to_hf(state, ours)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    with pytest.raises(ValueError, match="have no fastpar name"):
        llama_hf.from_hf(hf_state, {**c, "model_type": "fake_plain", "attention_bias": False})
    monkeypatch.delitem(families.REGISTRY, family)  # the dense family with these attentions
    assert llama_hf.hf_model_type(ours) == FAKE


def _deepseek_block(cls_name: str):
    """A DeepSeek-V3 MoE block (sigmoid, groups, scaling, shared experts, nonzero score bias)
    of a subclass named ``cls_name``, random weights."""
    transformers = pytest.importorskip("transformers")
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    cfg = transformers.DeepseekV3Config(
        hidden_size=H, hidden_act="silu", **BLOCKS["deepseek_v3"][3]
    )
    block = type(cls_name, (ds.DeepseekV3MoE,), {})(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        block.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen))
    return block.eval()


def test_a_moe_block_record_says_its_routing(monkeypatch):
    """A new block class registered with DeepSeek-V3's record converts to the layer computing
    what the block computes (and exports back to its state dict); the same block under a record
    with Mixtral's routing facts is converted to another function."""
    from fastpar.moe.hf import moe_from_hf, moe_to_hf_state_dict

    block = _deepseek_block("ToyRoutedMoE")
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    want = block(x)
    record = dataclasses.replace(families.DEEPSEEK_V3_BLOCK, name="toy", classes=("ToyRoutedMoE",))
    monkeypatch.setitem(families.REGISTRY, "toy", families.Family("toy", moe=record))
    moe = moe_from_hf(block).eval()
    assert moe.hf_family == "toy"
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-6)
    sd = moe_to_hf_state_dict(moe)
    assert sd.keys() == block.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in block.state_dict().items())
    plain = dataclasses.replace(record, score="softmax", groups=False, scaling=False)
    monkeypatch.setitem(families.REGISTRY, "toy", families.Family("toy", moe=plain))
    other = moe_from_hf(block).eval()
    assert (other.router.score, other.router.num_groups) == ("softmax", None)
    assert not torch.allclose(other(x), want, rtol=1e-3, atol=1e-3)


def _copies(monkeypatch) -> dict[str, str]:
    """Every style registered again under a new name, its record otherwise the same."""
    new = {name: f"{name}_b" for name in STYLES}
    for name, copy in new.items():
        monkeypatch.setitem(styles.STYLES, copy, dataclasses.replace(styles.get(name), name=copy))
    return new


def test_a_style_behaves_by_its_record_not_its_name(monkeypatch):
    new = _copies(monkeypatch)
    family = families.get("qwen3_moe")
    plan = {k: new.get(v, v) for k, v in family.plan.items()}
    monkeypatch.setitem(families.REGISTRY, "qwen3_moe", dataclasses.replace(family, plan=plan))
    record = parallelize(build("qwen3_moe")).fastpar_plan
    # the experts copy converts the MoE block and, in a built-in plan, skips the dense MLP
    # (mlp_only_layers=[1]); the column copy's split output reaches the per_head copy
    assert record.styles["model.layers.0.mlp"] == "experts_b"
    assert "model.layers.1.mlp" not in record.styles
    assert record.styles["model.layers.1.mlp.down_proj"] == "row_b"
    assert len(record.grad_reduced) == 4 and record.found_by_probe == []
    with pytest.raises(ValueError, match=r"config\.output_router_logits=True makes"):
        parallelize(build("qwen3_moe", output_router_logits=True))
    with pytest.raises(TypeError, match="plan style 'experts_b' needs a Hugging Face MoE block"):
        parallelize(build("qwen3_moe"), {"model.layers.*.mlp": "experts_b"})  # a caller's plan

    qwen3 = {
        k: new[v] if isinstance(v, str) else (new[v[0]], v[1])
        for k, v in builtin_plan(build("qwen3")).items()
    }
    wrong = {**qwen3, "model.layers.*.self_attn.q_norm": "replicate_b"}
    with pytest.raises(ValueError, match=r"q_norm' 'replicate_b' but its parameter .* 'per_head'"):
        parallelize(build("qwen3"), wrong)
    wrong = {**qwen3, "model.layers.*.input_layernorm": "per_head_b"}
    with pytest.raises(ValueError, match="layernorm' 'per_head_b' but it never sees a split"):
        parallelize(build("qwen3"), wrong)
    assert len(parallelize(build("qwen3"), qwen3, check=False).fastpar_plan.grad_reduced) == 4
    kept = {k: "replicate_b" if v == "per_head_b" else v for k, v in qwen3.items()}
    assert parallelize(build("qwen3"), kept, check=False).fastpar_plan.grad_reduced == []
    del kept["model.layers.*.self_attn.q_norm"]
    with pytest.raises(ValueError, match=r"q_norm.weight' sits inside .* as 'per_head'"):
        parallelize(build("qwen3"), kept, check=False)


def _plan_help() -> str:
    return next(a.help for a in build_parser()._actions if "--plan" in a.option_strings)


def test_the_docs_hint_and_help_list_every_style(monkeypatch):
    text = (pathlib.Path(__file__).parent.parent / "docs" / "hf.md").read_text()
    listed = re.search(r"pattern → style \(((?:`\w+`,\s*)+)or `\[style", text)
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(styles.STYLES)
    bullet = re.search(r"\*\*Styles\*\*:(.*?)\n- ", text, re.S).group(1)
    assert list(dict.fromkeys(re.findall(r'`"(\w+)"`', bullet))) == list(styles.STYLES)
    assert styles.listing() == ", ".join(STYLES)
    assert f"style ({styles.listing()}; or [style" in models_hf.plan_hint()
    assert f"style ({styles.listing()}; or [style" in _plan_help()
    _copies(monkeypatch)  # the help is made with the parser: a style registered since is listed
    assert f"({', '.join(STYLES)}, column_b, row_b, " in _plan_help()
