"""``--init-from-hf DIR``: a run starts from a save_pretrained directory's weights (each rank
reading its slices), its first loss is the HF model's own on the same batch, its export is the
fine-tuned model, and a resumed run takes the checkpoint's weights, not the directory's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from _hf import FAMILIES, exact, transformers
from _hf import build as hf_build

from fastpar.checkpoint import export_state_dict
from fastpar.export import fastpar_model
from fastpar.export import main as export_main
from fastpar.models.hf import hf_blocks, load_config, load_pretrained
from fastpar.tolerance import assert_agree
from fastpar.train import TrainConfig, batch_of, launch, load_data

SMALL = dict(batch_size=8, seq_len=32, quiet=True, pack="stream", ep=1)


def _pretrained(tmp_path, family: str, seed: int = 7, **overrides) -> str:
    """A save_pretrained directory of a small random ``family`` model (vocab 300: byte data)."""
    out = str(tmp_path / f"{family}_{seed}")
    hf_build(family, seed=seed, vocab_size=300, **overrides).save_pretrained(out)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_loads_the_directory_exactly(tmp_path, family):
    directory = _pretrained(tmp_path, family)
    parts = hf_blocks(load_config(os.path.join(directory, "config.json")), None)
    stage = torch.nn.Sequential(*parts.blocks)
    stats = load_pretrained(parts, stage, directory)
    want = getattr(transformers, FAMILIES[family][1]).from_pretrained(directory).state_dict()
    got = parts.names(stage)
    assert got and stats.loaded
    for name, p in got.items():
        assert torch.equal(p, want[name].float()), name  # a copy: bit for bit


def _hf_loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize(
    "family, layout", [("llama", dict(tp=2, pp=2, dp=1)), ("gpt2", dict(tp=2, pp=1, dp=2))]
)
def test_first_loss_is_the_hf_models_and_the_export_is_the_fine_tuned_model(
    tmp_path, family, layout
):
    directory = _pretrained(tmp_path, family)
    ckpt = str(tmp_path / "ckpt")
    cfg = TrainConfig.from_flags(
        **SMALL, **layout, steps=2, init_from_hf=directory, checkpoint_dir=ckpt
    )
    assert cfg.hf_config == os.path.join(directory, "config.json")  # the model is the dir's
    records = launch(cfg)
    x, y, docs = batch_of(cfg, load_data(cfg), 0)
    assert docs is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    with torch.no_grad():
        single = _hf_loss(hf, x, y)
        ref = _hf_loss(exact(hf), x, y)
    hidden = hf.config.hidden_size
    ffn = getattr(hf.config, "intermediate_size", None) or 4 * hidden
    length = max(hidden, ffn, hf.config.vocab_size, x.numel())  # the longest sum into the loss
    assert_agree(records[0]["loss"], single, ref, length=length, what="step 1 loss")

    out = str(tmp_path / "hf_out")
    assert export_main([ckpt, out]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    state = export_state_dict(os.path.join(ckpt, "step_000002"))
    ours = fastpar_model(cfg, state).eval()
    moved = [k for k, v in tuned.state_dict().items() if not torch.equal(v, hf.state_dict()[k])]
    assert moved  # trained: the export is not the pretrained directory
    with torch.no_grad():
        got, want = tuned(x).logits, ours(x)
        ref64 = exact(tuned)(x).logits
    assert_agree(got, want, ref64, length=length, what="logits of the export")


def test_resume_takes_the_checkpoint_not_the_directory(tmp_path):
    directory = _pretrained(tmp_path, "llama")
    ckpt = tmp_path / "ckpt"
    common = dict(SMALL, tp=2, pp=1, dp=1, steps=2, save_every=1, init_from_hf=directory)
    first = launch(TrainConfig.from_flags(**common, checkpoint_dir=str(ckpt)))
    shutil.rmtree(ckpt / "step_000002")
    # the directory now holds other weights of the same model: a resume must not read them
    other = _pretrained(tmp_path, "llama", seed=8)
    for name in os.listdir(other):
        if name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(other, name), os.path.join(directory, name))
    resumed = launch(TrainConfig.from_flags(**common, checkpoint_dir=str(ckpt), resume=True))
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == first[1]["loss"]  # step 2 from step 1's checkpoint, exactly


def test_errors(tmp_path):
    directory = _pretrained(tmp_path, "llama")
    with pytest.raises(ValueError, match=r"holds no config\.json"):
        TrainConfig.from_flags(**SMALL, init_from_hf=str(tmp_path)).check()
    other = tmp_path / "other.json"
    raw = json.loads((tmp_path / directory / "config.json").read_text())
    other.write_text(json.dumps(dict(raw, num_hidden_layers=3)))
    with pytest.raises(ValueError, match=r"differs from .*num_hidden_layers.*drop --hf-config"):
        TrainConfig.from_flags(**SMALL, init_from_hf=directory, hf_config=str(other)).check()
    same = tmp_path / "same.json"
    same.write_text(json.dumps(raw))
    TrainConfig.from_flags(
        **SMALL, init_from_hf=directory, hf_config=str(same)
    ).check()  # consistent: ok
    os.remove(os.path.join(directory, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        TrainConfig.from_flags(**SMALL, init_from_hf=directory).check()
