"""Every ``--model gpt`` checkpoint leaves fastpar: the ones GPT-2 cannot compute (the trainer's
default: RMSNorm, MoE blocks) export as ``FastparGPTForCausalLM``, whose code
(``fastpar/models/hf_code``) goes into the directory, and load with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` computing fastpar's logits
(``fastpar.tolerance``'s rule against fastpar's model in float64)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from _flags import SIGMOID_GROUPS
from _hf import transformers

from fastpar.checkpoint import export_hf
from fastpar.export import fastpar_model, run_config
from fastpar.models import build_model, gpt_code
from fastpar.models.hf_code.modeling_fastpar_gpt import FastparGPTForCausalLM
from fastpar.tolerance import assert_agree, cast
from fastpar.train import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, module: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


def _load(out: str):
    return transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


def _length(cfg: TrainConfig, tokens: int) -> int:
    """The longest sum into a logit: the hidden or MLP width, or the attended tokens."""
    model = cfg.model
    shared = model.moe_experts.shared_ffn_hidden_size
    return max(model.hidden, model.ffn or 4 * model.hidden, shared or 0, tokens)


def test_the_default_run_exports_and_loads_in_transformers(tmp_path):
    """``python -m fastpar.train`` with no model flags (world 8: dp 2 x tp 2 x pp 2, ep 2; gpt,
    RMSNorm, MoE every 2nd block), then ``python -m fastpar.export --check --generate``."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    r = _run(
        tmp_path, "fastpar.train", "--steps", "2", "--checkpoint-dir", ckpt, "--save-every", "2"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MoE every 2" in r.stdout and "world 8" in r.stdout
    r = _run(tmp_path, "fastpar.export", ckpt, out, "--check", "--generate", "6")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "transformers FastparGPTForCausalLM" in r.stdout and ": equal" in r.stdout
    assert "fastpar's own greedy decoding: the same tokens" in r.stdout
    for name in ("config.json", "model.safetensors", *gpt_code.CODE_FILES):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    assert saved["model_type"] == "fastpar_gpt" and saved["norm"] == "rmsnorm"
    assert saved["moe_every"] == 2 and saved["num_experts"] == 4

    path = os.path.join(ckpt, "step_000002")
    cfg = run_config(path)
    from fastpar.checkpoint import export_state_dict

    state = export_state_dict(path)
    ours = fastpar_model(cfg, state).eval()
    hf = _load(out)
    assert type(hf).__name__ == "FastparGPTForCausalLM"
    assert hf.lm_head.weight is hf.transformer.wte.weight  # tied, as trained
    ids = torch.randint(
        0, cfg.vocab, (3, cfg.model.seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        got, single = hf(ids).logits, ours(ids)
        exact = cast(copy.deepcopy(ours), torch.float64)(ids)
        loss = hf(ids, labels=ids).loss
    assert_agree(got, single, exact, length=_length(cfg, cfg.model.seq_len), what="exported logits")
    want = torch.nn.functional.cross_entropy(
        exact[:, :-1].reshape(-1, exact.shape[-1]), ids[:, 1:].reshape(-1)
    )
    single_loss = torch.nn.functional.cross_entropy(
        single[:, :-1].reshape(-1, single.shape[-1]), ids[:, 1:].reshape(-1)
    )
    assert_agree(loss, single_loss, want, length=ids.numel(), what="HF loss with labels")


OPTIONS = {
    "default": dict(),
    "deepseek-style": dict(
        SIGMOID_GROUPS,
        **dict(routed_scaling_factor=2.5, shared_expert_ffn=32, shared_expert_gate=True),
        untied=True,
    ),
    "layernorm-moe-top1": dict(norm="layernorm", moe_every=1, top_k=1, ep=1),
    "dense-rmsnorm": dict(moe_every=0, ep=1),
    "more-experts": dict(experts=8, top_k=3, router_groups=4, router_group_topk=2),
}


def _random_model(cfg: TrainConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*build_model(cfg.model, None)).eval()
    with torch.no_grad():  # trained biases and norms, not their initial 0 / 1
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("b1", "b2", "bias")):
                t.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_gpt_option_computes_fastpars_function(tmp_path, name):
    cfg = TrainConfig.from_flags(**OPTIONS[name])
    model = _random_model(cfg, seed=3)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = str(tmp_path / "hf")
    config = gpt_code.hf_config(cfg.model)
    export_hf(
        gpt_code.to_hf(state, cfg.model),
        out,
        FastparGPTForCausalLM.config_class(**config),
        model_class=FastparGPTForCausalLM,
    )
    gpt_code.write_code(out)
    hf = _load(out)
    assert hf.config.tie_word_embeddings is cfg.model.tie_embeddings
    ids = torch.randint(0, cfg.vocab, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, single = hf(ids).logits, model(ids).view(*ids.shape, -1)
        exact = cast(copy.deepcopy(model), torch.float64)(ids).view(*ids.shape, -1)
    assert_agree(got, single, exact, length=_length(cfg, 48), what=f"{name} logits")


def test_left_padded_rows_compute_the_unpadded_rows(tmp_path):
    cfg = TrainConfig.from_flags()
    model = _random_model(cfg, seed=4)
    out = str(tmp_path / "hf")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = FastparGPTForCausalLM.config_class(**gpt_code.hf_config(cfg.model))
    export_hf(gpt_code.to_hf(state, cfg.model), out, config, model_class=FastparGPTForCausalLM)
    gpt_code.write_code(out)
    hf = _load(out)
    g = torch.Generator().manual_seed(5)
    short, long = (
        torch.randint(1, 256, (1, 9), generator=g),
        torch.randint(1, 256, (1, 14), generator=g),
    )
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    with torch.no_grad():
        padded = hf(batch, attention_mask=mask).logits
        alone = hf(short).logits
        exact = cast(copy.deepcopy(model), torch.float64)(short).view(1, 9, -1)
    assert_agree(padded[:1, 5:], alone, exact, length=_length(cfg, 14), what="padded row")
    # the unpadded row of the same batch is the plain causal computation
    with torch.no_grad():
        assert torch.equal(hf(long).logits, hf(long, attention_mask=torch.ones_like(long)).logits)


def test_capacity_factor_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--capacity-factor 1\.25"):
        gpt_code.hf_config(TrainConfig.from_flags(capacity_factor=1.25).model)
