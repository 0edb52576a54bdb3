"""``python -m fastpar.export`` of a ``--model gpt`` run: GPT-2 (``GPT2LMHeadModel``) with
fastpar's logits, the run's special tokens in the config and tokenizer; GPTs that GPT-2 cannot
compute are refused by GPT-2's mapping, naming the option, and export as fastpar's own model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _flags import tiny_config
from _hf import transformers

from fastpar.checkpoint import export_state_dict
from fastpar.export import fastpar_model
from fastpar.export import main as export_main
from fastpar.models import gpt_hf
from fastpar.tokenizer import main as tokenizer_main
from fastpar.tolerance import assert_agree, cast
from fastpar.train import TrainConfig, launch

SMALL = tiny_config(seq_len=32)
GPT2 = dict(norm="layernorm", moe_every=0, ep=1)


def _train(tmp_path, **kw) -> str:
    ckpt = tmp_path / "ckpt"
    launch(TrainConfig.from_flags(**{**SMALL, **kw, "checkpoint_dir": str(ckpt), "save_every": 2}))
    return str(ckpt / "step_000002")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok") / "tok.json")
    assert tokenizer_main(["--vocab-size", "300", "--out", path]) == 0
    return path


@pytest.mark.parametrize(
    "layout", [dict(tp=2, pp=2, dp=1), dict(tp=2, pp=1, dp=2, untied=True)], ids=["tied", "untied"]
)
def test_gpt_run_exports_as_gpt2_with_fastpars_logits(tmp_path, tok, capsys, layout):
    path = _train(tmp_path, **GPT2, **layout, tokenizer=tok)
    out = str(tmp_path / "hf")
    assert export_main([path, out, "--check", "--generate", "5", "--prompt", "Simple is"]) == 0
    text = capsys.readouterr().out
    assert "transformers GPT2LMHeadModel" in text and ": equal" in text
    assert "fastpar's own greedy decoding: the same tokens" in text

    hf = transformers.GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager").eval()
    assert hf.config.activation_function == "gelu" and hf.config.n_inner == 4 * SMALL["hidden"]
    assert hf.config.tie_word_embeddings is not layout.get("untied", False)
    assert (hf.lm_head.weight is hf.transformer.wte.weight) is not layout.get("untied", False)
    from fastpar.export import run_config

    cfg = run_config(path)
    ours = fastpar_model(cfg, export_state_dict(path)).eval()
    ids = torch.randint(
        0, cfg.vocab, (3, SMALL["seq_len"]), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        got, single = hf(ids).logits, ours(ids)
        exact = cast(copy.deepcopy(ours), torch.float64)(ids)
    length = max(
        cfg.model.hidden, 4 * cfg.model.hidden, SMALL["seq_len"]
    )  # the longest sum into a logit
    assert_agree(got, single, exact, length=length, what="GPT-2 logits")

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert (
        hf.config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    )
    with open(f"{out}/config.json") as f:
        saved = json.load(f)
    assert saved["model_type"] == "gpt2" and saved["eos_token_id"] == tokenizer.eos_token_id


def test_llama_export_carries_eos(tmp_path, tok):
    path = _train(tmp_path, model_type="llama", tokenizer=tok, tp=1, pp=1, dp=1, ep=1, moe_every=0)
    out = str(tmp_path / "hf")
    assert export_main([path, out]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    config = transformers.AutoConfig.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert config.eos_token_id == tokenizer.eos_token_id is not None


def test_gpt2_refuses_what_it_cannot_compute_naming_the_option():
    """GPT-2 has LayerNorm and dense blocks only; such runs export as fastpar's own model
    (``tests/test_export_fastpar_gpt.py``), never as a GPT-2 computing something else."""
    with pytest.raises(ValueError, match="--moe-every 2"):
        gpt_hf.hf_config(TrainConfig.from_flags(norm="layernorm", moe_every=2).model)
    with pytest.raises(ValueError, match="--norm layernorm"):  # the default run: RMSNorm + MoE
        gpt_hf.hf_config(TrainConfig.from_flags().model)
    with pytest.raises(ValueError, match="--norm layernorm"):
        gpt_hf.to_hf({}, TrainConfig.from_flags(moe_every=0, ep=1).model)


def test_rmsnorm_run_exports_as_fastpar_gpt(tmp_path, capsys):
    rms = _train(tmp_path, tp=1, pp=1, dp=1, ep=1, moe_every=0)  # --norm rmsnorm (default)
    assert export_main([rms, str(tmp_path / "hf"), "--check"]) == 0
    assert "transformers FastparGPTForCausalLM" in capsys.readouterr().out
