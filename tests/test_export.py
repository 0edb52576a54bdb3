"""``python -m fastpar.export``: a training checkpoint of any layout -> an HF directory that
transformers loads with fastpar's logits and greedy tokens."""

from __future__ import annotations

import json

from _flags import ONE_RANK, SIZES, tiny_config, with_hf_config
from _hf import config as hf_config
from _hf import transformers

from fastpar import checkpoint
from fastpar.export import main as export_main
from fastpar.tokenizer import main as tokenizer_main
from fastpar.train import TrainConfig, launch

SMALL = tiny_config(seq_len=32)


def _train(tmp_path, **kw) -> str:
    small = {k: v for k, v in SMALL.items() if "hf_config" not in kw or k not in SIZES}
    cfg = TrainConfig.from_flags(
        **{**small, **kw, "checkpoint_dir": str(tmp_path / "ckpt"), "save_every": 2}
    )
    launch(cfg)
    return str(tmp_path / "ckpt" / "step_000002")


def test_llama_run_exports_and_matches(tmp_path, capsys):
    tok = str(tmp_path / "tok.json")
    assert tokenizer_main(["--vocab-size", "300", "--out", tok]) == 0
    layout = dict(ONE_RANK, tp=2, pp=2, dp=2)
    path = _train(tmp_path, model_type="llama", tokenizer=tok, **layout, kv_heads=2, qk_norm=True)
    out = str(tmp_path / "hf")
    assert export_main([path, out, "--check", "--generate", "5", "--prompt", "Simple is"]) == 0
    text = capsys.readouterr().out
    assert "transformers Qwen3ForCausalLM" in text and ": equal" in text
    assert "fastpar's own greedy decoding: the same tokens" in text
    with open(f"{out}/config.json") as f:
        assert json.load(f)["model_type"] == "qwen3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)  # the run's tokenizer came along
    assert tokenizer("Simple is")["input_ids"]


def test_hf_config_run_exports_under_its_own_names(tmp_path, capsys):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(hf_config("llama", vocab_size=300).to_dict()))
    ckpt = _train(tmp_path, **with_hf_config(dict(tp=2, pp=2, dp=1, ep=1), path))
    assert export_main([ckpt, str(tmp_path / "hf"), "--check"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out


def test_check_with_its_defaults_fits_a_short_model(tmp_path, capsys):
    """The default prompt (24 bytes) on a model trained at --seq-len 16: cut to fit, said so;
    a --generate that leaves no room for a prompt is refused naming the range."""
    path = _train(tmp_path, seq_len=16, tp=1, pp=1, dp=1, ep=1)
    assert export_main([path, str(tmp_path / "hf"), "--check"]) == 0
    text = capsys.readouterr().out
    assert (
        "the prompt's 24 tokens + --generate 0 exceed the run's seq_len 16: checking with its "
        "first 16 tokens" in text
    )
    assert "over 16 tokens" in text and ": equal" in text
    assert export_main([path, str(tmp_path / "hf2"), "--check", "--generate", "4"]) == 0
    text = capsys.readouterr().out
    assert "first 12 tokens" in text and "the same tokens" in text
    assert export_main([path, str(tmp_path / "hf3"), "--check", "--generate", "16"]) == 2
    assert "--generate 16 leaves no room for a prompt in the run's seq_len 16: use 0 to 15" in (
        capsys.readouterr().err
    )


def test_errors(tmp_path, capsys):
    dropping = _train(tmp_path, tp=1, pp=1, dp=1, ep=1, capacity_factor=1.25)
    assert export_main([dropping, str(tmp_path / "hf")]) == 2
    assert "--capacity-factor 1.25: a capacity drops tokens" in capsys.readouterr().err
    bare = str(tmp_path / "bare")
    import torch

    p = torch.nn.Parameter(torch.ones(3))
    checkpoint.save(bare, model_params={"w": p}, step=0)
    assert export_main([bare, str(tmp_path / "hf2")]) == 2
    assert "holds no training settings" in capsys.readouterr().err
