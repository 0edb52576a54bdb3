"""Small Hugging Face models (random init, built from configs: nothing is downloaded) for the
parallelize / verify tests: one per family with a built-in plan."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install fastpar[hf])")

VOCAB = 101  # odd: the vocabulary shards need padding at TP 2 and 4

DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=64,
)
_MOE = dict(DECODER, intermediate_size=24)

FAMILIES = {
    "llama": ("LlamaConfig", "AutoModelForCausalLM", DECODER),
    "mistral": ("MistralConfig", "AutoModelForCausalLM", dict(DECODER, sliding_window=None)),
    "qwen2": ("Qwen2Config", "AutoModelForCausalLM", DECODER),  # q/k/v biases
    "qwen3": ("Qwen3Config", "AutoModelForCausalLM", dict(DECODER, tie_word_embeddings=True)),
    "mixtral": (
        "MixtralConfig",
        "AutoModelForCausalLM",
        dict(_MOE, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "AutoModelForCausalLM",
        dict(
            _MOE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "AutoModelForCausalLM",
        dict(
            _MOE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=12,
            norm_topk_prob=False,
        ),
    ),
    "deepseek_v3": (  # MLA (q_lora_rank set; None in tests/test_hf_deepseek.py) + DeepSeekMoE
        "DeepseekV3Config",
        "AutoModelForCausalLM",
        dict(
            _MOE,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=12,
            kv_lora_rank=10,
            qk_rope_head_dim=4,
            head_dim=4,  # the rotary width: qk_rope_head_dim
            qk_nope_head_dim=6,
            v_head_dim=5,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        "AutoModelForCausalLM",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    ),
    "bert": (
        "BertConfig",
        "AutoModelForMaskedLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
        ),
    ),
}


def config(family: str, **overrides):
    cls_name, _, kwargs = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    # no dropout: runs must be reproducible across layouts
    for key in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "attention_dropout",
    ):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    cfg._attn_implementation = "eager"
    return cfg


def build(family: str, seed: int = 0, **overrides):
    """The model of ``family`` drawn under ``seed`` (the same on every rank)."""
    import torch

    _, auto, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config(family, **overrides))
    return model.float()


def max_tp(family: str) -> int:
    heads = FAMILIES[family][2].get("num_key_value_heads") or FAMILIES[family][2].get(
        "n_head", FAMILIES[family][2].get("num_attention_heads")
    )
    return heads


def exact(model):
    """A float64 copy of the HF ``model`` (same weights): the exact math of its single-process
    run (``fastpar.tolerance.cast``: its MoE experts in HF's eager loop, which has float64)."""
    import copy

    import torch

    from fastpar.tolerance import cast

    return cast(copy.deepcopy(model), torch.float64)
