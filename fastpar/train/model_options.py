"""The model's flags of ``python -m fastpar.train`` (the "model" section of --help), declared as
the fields of ``ModelOptions``, the base of ``fastpar.train.options.TrainOptions``."""

from __future__ import annotations

from dataclasses import dataclass

from fastpar.cliutil import option
from fastpar.models import native
from fastpar.models.mtp import DEFAULT_COEF
from fastpar.nn import styles

MODEL = "model"


@dataclass
class ModelOptions:
    """The flags that choose the model and its shape (``option(resume=...)``: what resuming a
    checkpoint with another value does)."""

    model_type: str = option(
        "gpt",
        MODEL,
        words=native.REGISTRY,
        help="the model: fastpar's GPT, its Llama (GQA, RoPE, SwiGLU, RMSNorm), or its "
        "DeepSeek-V3 class (multi-head latent attention, DeepSeekMoE after --first-k-dense "
        "dense blocks)",
        resume="refuse",
    )
    hf_config: str | None = option(
        None,
        MODEL,
        metavar="FILE",
        help="a Hugging Face config.json: train that model (random init) with its family's "
        "built-in plan instead of the GPT / Llama",
    )
    vocab_size: int | None = option(
        None,
        MODEL,
        help="vocabulary size (default: the tokenizer's, else 256 bytes)",
    )
    seq_len: int = option(64, MODEL, "tokens per sequence", resume="warn", at_least=1)
    hidden: int = option(64, MODEL, "model width", resume="refuse", at_least=1)
    heads: int = option(4, MODEL, "attention heads", resume="refuse", at_least=1)
    layers: int = option(4, MODEL, "transformer blocks", resume="refuse", at_least=1)
    init_from_hf: str | None = option(
        None,
        MODEL,
        metavar="DIR",
        help="a local Hugging Face directory (config.json + *.safetensors, as save_pretrained "
        "writes it): train that model from its weights (implies --hf-config DIR/config.json; "
        "each rank reads its slices; fresh optimizer, step 0; --resume's checkpoint wins)",
    )
    ffn: int | None = option(
        None,
        MODEL,
        help="MLP width (default: gpt 4*hidden, llama 8*hidden/3 rounded up to 64)",
        resume="refuse",
        at_least=1,
        note="or left out: its default",
    )
    moe_ffn: int | None = option(
        None, MODEL, "llama / deepseek: width of each expert (default: --ffn)", resume="refuse"
    )
    kv_heads: int | None = option(
        None,
        MODEL,
        help="llama: key/value heads for grouped-query attention (default: --heads)",
        resume="refuse",
    )
    head_dim: int | None = option(
        None, MODEL, "llama: width of a head (default: hidden / heads)", resume="refuse"
    )
    rope_theta: float = option(
        10000.0, MODEL, "llama: RoPE base", resume="warn", finite=True, note="e.g. 10000"
    )
    qk_norm: bool = option(
        False, MODEL, "llama: Qwen3-style RMSNorm on every query and key head", resume="refuse"
    )
    attention_bias: bool = option(False, MODEL, "llama: Qwen2-style q/k/v bias", resume="refuse")
    q_lora_rank: int = option(
        32, MODEL, "deepseek: low-rank query's rank (0: one q projection)", resume="refuse"
    )
    kv_lora_rank: int = option(
        32, MODEL, "deepseek: width of the compressed key/value latent", resume="refuse"
    )
    qk_rope_head_dim: int = option(
        8, MODEL, "deepseek: rotary dims of a query/key head (even)", resume="refuse"
    )
    qk_nope_head_dim: int = option(
        16, MODEL, "deepseek: dims without position of a query/key head", resume="refuse"
    )
    v_head_dim: int = option(16, MODEL, "deepseek: width of a value head", resume="refuse")
    first_k_dense: int = option(
        1, MODEL, "deepseek: the first K blocks dense, the rest MoE", resume="refuse"
    )
    rope_interleave: bool = option(True, MODEL, "deepseek: rotary dims paired", resume="warn")
    yarn_factor: float | None = option(None, MODEL, "deepseek: YaRN scaling factor", resume="warn")
    yarn_original_seq_len: int | None = option(
        None, MODEL, "deepseek YaRN: pre-training length (default: --seq-len)", resume="warn"
    )
    yarn_beta_fast: float = option(32.0, MODEL, "deepseek --yarn-factor: beta_fast", resume="warn")
    yarn_beta_slow: float = option(1.0, MODEL, "deepseek --yarn-factor: beta_slow", resume="warn")
    yarn_mscale: float = option(1.0, MODEL, "deepseek --yarn-factor: mscale", resume="warn")
    yarn_mscale_all_dim: float = option(
        0.0, MODEL, "deepseek YaRN: mscale_all_dim (squared, scales the softmax)", resume="warn"
    )
    norm: str = option(
        "rmsnorm",
        MODEL,
        words=("rmsnorm", "layernorm"),
        help="gpt: the normalisation layers",
        resume="refuse",
    )
    untied: bool = option(
        False, MODEL, "an LM head of its own instead of the embedding's weight", resume="refuse"
    )
    mtp_depth: int = option(
        0,
        MODEL,
        help="llama / deepseek: DeepSeek-V3 multi-token prediction, D sequential modules "
        "(module k predicts the token k + 1 ahead, sharing the embedding and head; 0: off)",
        resume="refuse",
    )
    mtp_loss_coef: float = option(
        DEFAULT_COEF,
        MODEL,
        help="the MTP loss weight lambda: loss = main + lambda / D * sum of the depths' "
        "cross-entropies (Megatron's default; DeepSeek-V3 trained with 0.3, then 0.1)",
        resume="warn",
    )
    moe_every: int | None = option(
        None,
        MODEL,
        deferred=True,
        help="every N-th block's MLP is a mixture of experts (0: no MoE blocks; default 2; "
        "deepseek: 1, every block after --first-k-dense)",
        resume="refuse",
        at_least=0,
        note="0: no MoE blocks",
    )
    experts: int = option(4, MODEL, "experts per MoE layer", resume="refuse", at_least=1)
    top_k: int = option(2, MODEL, "experts each token is routed to", resume="warn", at_least=1)
    capacity_factor: float | None = option(
        None,
        MODEL,
        help="MoE capacity factor: tokens over capacity are dropped (default: dropless)",
        resume="warn",
        positive=True,
        note="e.g. 1.25, or left out: dropless routing",
    )
    plan: str | None = option(
        None,
        MODEL,
        metavar="FILE",
        help=lambda: (
            "with --hf-config: the tensor-parallel plan, a TOML or JSON table of "
            f"module-name pattern -> style ({styles.listing()}; or [style, {{options}}]) as "
            "fastpar.parallelize takes it, for a family without a built-in plan (or to replace "
            "it); the LM head's logits stay split over the vocabulary"
        ),
    )
