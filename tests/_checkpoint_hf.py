"""The Hugging Face checkpoint tests' models, defined once: ``KINDS`` (test model -> a
tests/_hf.py family and its config overrides), ``dense_model(kind, seed)`` and its
``model_config``, ``tp_model`` (``PLAN`` for the Llama-likes, the built-in plans for GPT-2 and
BERT), and the verdicts on logits: ``same_logits`` (bit for bit, ``EXACT``) and ``logits_agree``
(``fastpar.tolerance``'s rule); ``from_pretrained`` (nothing missing or unexpected) and
``file_tensors``. Import it after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import os

import _hf
import torch
from _parity import agree, exact_copy
from torch import nn

from fastpar import parallelize
from fastpar.tolerance import nudge

PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.[qkv]_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
    "lm_head": ("column", {"gather_output": True, "pad_output": True}),
}
KINDS = {  # test model -> (tests/_hf.py family, config overrides)
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "qwen2": ("qwen2", {}),  # q / k / v projections with biases
    "gpt2": ("gpt2", {}),  # Conv1D layers, fused q|k|v, biases, a tied LM head
    "bert": ("bert", {"architectures": ["BertForMaskedLM"]}),  # tied decoder weight and bias
}
EXACT = dict(rtol=0, atol=0)  # copies, and the same model on the same weights


def model_config(kind: str):
    family, overrides = KINDS[kind]
    return _hf.config(family, **overrides)


def tp_model(model: nn.Module, mesh=None) -> nn.Module:
    """TP over the default group (or ``mesh``): the explicit plan for Llama-like models, the
    built-in one (fastpar.nn.plans) for GPT-2 and BERT."""
    if model.config.model_type in ("llama", "qwen2"):
        return parallelize(model, PLAN, mesh=mesh)
    return parallelize(model, mesh=mesh)


def dense_model(kind: str, seed: int = 0) -> nn.Module:
    """The test model drawn under ``seed``, every parameter (biases and norms too) moved off
    its init by a seeded perturbation."""
    family, overrides = KINDS[kind]
    model = _hf.build(family, seed, **overrides)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return model.eval()


def input_ids(vocab: int = _hf.VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(5))


def same_logits(model: nn.Module, dense: nn.Module) -> None:
    """Bit for bit: ``model`` is ``dense``'s class holding the same weights (loaded back)."""
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids()).logits, dense(input_ids()).logits, **EXACT)


def logits_agree(model: nn.Module, dense: nn.Module, what: str) -> None:
    """``model``'s logits (a parallel layout of ``dense``) by the rule: against ``dense`` in
    float64, with ``dense`` in fp32 and its twin as the measure of rounding."""
    twin, exact = exact_copy(dense).float(), exact_copy(dense)
    nudge(twin, seed=1)
    ids = input_ids()
    with torch.no_grad():
        runs = [m(ids).logits for m in (dense, twin, exact)]
        got = model(ids).logits
    length = max(ids.numel(), *(max(p.shape) for p in dense.parameters()))
    agree(got, runs[:2], runs[2], what, length=length)


def from_pretrained(out: str, auto=None):
    """``out`` loaded by transformers (``auto``, else ``AutoModelForCausalLM``): no key missing,
    unexpected or mismatched."""
    import transformers

    auto = auto or transformers.AutoModelForCausalLM
    # eager attention, as the models of tests/_hf.py use: the logits must be equal to the bit
    model, info = auto.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return model.eval()


def file_tensors(out: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``out``."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, f)))
    return tensors
