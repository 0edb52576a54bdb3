"""The fields every native model's config shares, declared once: ``DecoderShape`` (the shape and
the layout options of GPT, Llama and DeepSeek) and ``SwiGLUShape`` (with the RoPE, RMSNorm,
SwiGLU-expert and multi-token-prediction fields the Llama and the DeepSeek add). A model's
config inherits one, adds its own fields and may change a default (``fastpar.models.native``
says which trainer flag fills which field)."""

from __future__ import annotations

from dataclasses import dataclass

from fastpar.models.mtp import DEFAULT_COEF


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int = 256
    """Tokens in the vocabulary (the embedding and LM head rows; padded to a multiple of TP)."""
    seq_len: int = 64
    """Longest sequence (HF max_position_embeddings)."""
    hidden: int = 64
    """Model width (HF hidden_size)."""
    heads: int = 4
    """Query heads (HF num_attention_heads); divisible by TP."""
    layers: int = 4
    """Transformer blocks (HF num_hidden_layers)."""
    ffn: int | None = None
    """The dense MLP's width (HF intermediate_size); None: the model's ``ffn_size``."""
    tie_embeddings: bool = False
    """The LM head shares the token embedding (HF tie_word_embeddings)."""
    moe_every: int = 0
    """MoE blocks every this-many blocks (where exactly: the model's ``is_moe``); 0: none."""
    num_experts: int = 4
    """MoE experts (divisible by EP)."""
    top_k: int = 2
    """Experts per token (HF num_experts_per_tok)."""
    capacity_factor: float | None = None
    """MoE capacity factor (None: dropless, as HF's MoE models are)."""
    overlap_chunks: int = 1
    """MoE all-to-all / expert-compute overlap chunks (1: none)."""
    sequence_parallel: bool = False
    """Split activations between blocks along the sequence over TP (MoE blocks then route
    each TP rank's chunk, dropless, or gather it with moe_expert_tp)."""
    moe_expert_tp: bool = False
    """Split each expert's FFN over TP (expert tensor parallelism, ``fastpar.moe.tp``) instead
    of every TP rank holding whole experts."""
    cp_attention: str = "ring"
    """Attention under context parallelism: "ring" (K/V around the cp ranks) or "all-to-all"
    (heads scattered over cp; the local query heads must divide by cp)."""


@dataclass(frozen=True)
class SwiGLUShape(DecoderShape):
    rope_theta: float = 10000.0
    """RoPE base: inverse frequencies theta^(-2i / rotary dims)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (HF rms_norm_eps)."""
    moe_ffn: int | None = None
    """Each routed expert's SwiGLU width (HF moe_intermediate_size; Mixtral's
    intermediate_size). None: ffn."""
    norm_topk_prob: bool = True
    """Renormalise each token's k routing weights to sum to one (HF norm_topk_prob; Mixtral
    always does). False: the raw probabilities."""
    mtp_depth: int = 0
    """DeepSeek-V3 multi-token prediction: D sequential modules after the model, module k
    predicting the token k + 1 ahead (``fastpar.models.mtp``; HF num_nextn_predict_layers).
    0: off."""
    mtp_loss_coef: float = DEFAULT_COEF
    """The MTP loss weight lambda: loss = main + lambda / D · sum of the depths' losses."""
