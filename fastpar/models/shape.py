"""The fields every native model's config shares, declared once: ``DecoderShape`` (the shape and
the layout options of GPT, Llama and DeepSeek) and ``SwiGLUShape`` (with the RoPE, RMSNorm,
SwiGLU-expert and multi-token-prediction fields the Llama and the DeepSeek add). A model's
config inherits one, adds its own fields and may change a default. A field declared with
``option`` is also a flag of ``python -m fastpar.train`` (``fastpar.cliutil.Option``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastpar.cliutil import option
from fastpar.models.mtp import DEFAULT_COEF

MODEL, LAYOUT = "model", "layout"
"""The --help sections of ``python -m fastpar.train`` the model configs' flags are listed in."""


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int = 256
    """Tokens in the vocabulary (the embedding and LM head rows; padded to a multiple of TP)."""
    seq_len: int = option(64, MODEL, "tokens per sequence", resume="warn", at_least=1)
    """Longest sequence (HF max_position_embeddings)."""
    hidden: int = option(64, MODEL, "model width", resume="refuse", at_least=1)
    """Model width (HF hidden_size)."""
    heads: int = option(4, MODEL, "attention heads", resume="refuse", at_least=1)
    """Query heads (HF num_attention_heads); divisible by TP."""
    layers: int = option(4, MODEL, "transformer blocks", resume="refuse", at_least=1)
    """Transformer blocks (HF num_hidden_layers)."""
    ffn: int | None = option(
        None,
        MODEL,
        help="MLP width (default: gpt 4*hidden, llama 8*hidden/3 rounded up to 64)",
        resume="refuse",
        at_least=1,
        note="or left out: its default",
    )
    """The dense MLP's width (HF intermediate_size); None: the model's ``ffn_size``."""
    tie_embeddings: bool = option(
        False,
        MODEL,
        "an LM head of its own instead of the embedding's weight",
        name="untied",
        inverted=True,
        flag_default=False,  # the trainer ties every model's head unless --untied
        resume="refuse",
    )
    """The LM head shares the token embedding (HF tie_word_embeddings)."""
    moe_every: int = option(
        0,
        MODEL,
        deferred=True,
        help="every N-th block's MLP is a mixture of experts (0: no MoE blocks; default 2; "
        "deepseek: 1, every block after --first-k-dense)",
        resume="refuse",
        at_least=0,
        note="0: no MoE blocks",
    )
    """MoE blocks every this-many blocks (where exactly: the model's ``is_moe``); 0: none."""
    num_experts: int = option(
        4, MODEL, "experts per MoE layer", name="experts", resume="refuse", at_least=1
    )
    """MoE experts (divisible by EP)."""
    top_k: int = option(2, MODEL, "experts each token is routed to", resume="warn", at_least=1)
    """Experts per token (HF num_experts_per_tok)."""
    capacity_factor: float | None = option(
        None,
        MODEL,
        help="MoE capacity factor: tokens over capacity are dropped (default: dropless)",
        resume="warn",
        positive=True,
        note="e.g. 1.25, or left out: dropless routing",
    )
    """MoE capacity factor (None: dropless, as HF's MoE models are)."""
    overlap_chunks: int = option(
        1,
        LAYOUT,
        help="MoE: split the all-to-all into K chunks overlapped with expert GEMMs (1: no overlap)",
        at_least=1,
        note="1: no overlap",
    )
    sequence_parallel: bool = option(
        False,
        LAYOUT,
        help="split activations between blocks along the sequence over TP (MoE blocks route each "
        "rank's chunk, dropless; with --moe-expert-tp they gather it)",
    )
    moe_expert_tp: bool = option(
        False,
        LAYOUT,
        help="split each MoE expert's FFN over TP (expert tensor parallelism: w1 by columns, w2 by "
        "rows) instead of every TP rank holding whole experts",
    )
    cp_attention: str = option(
        "ring",
        LAYOUT,
        words=("ring", "all-to-all"),
        help="attention under --cp: ring (K/V passed around the cp ranks) or all-to-all (heads "
        "scattered over cp, Ulysses; heads / tp must divide by cp)",
    )

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) is a MoE block: every ``moe_every``-th one."""
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0


@dataclass(frozen=True)
class SwiGLUShape(DecoderShape):
    rope_theta: float = option(
        10000.0, MODEL, "llama: RoPE base", resume="warn", finite=True, note="e.g. 10000"
    )
    """RoPE base: inverse frequencies theta^(-2i / rotary dims)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (HF rms_norm_eps)."""
    moe_ffn: int | None = option(
        None, MODEL, "llama / deepseek: width of each expert (default: --ffn)", resume="refuse"
    )
    """Each routed expert's SwiGLU width (HF moe_intermediate_size; Mixtral's
    intermediate_size). None: ffn."""
    norm_topk_prob: bool = True
    """Renormalise each token's k routing weights to sum to one (HF norm_topk_prob; Mixtral
    always does). False: the raw probabilities."""
    mtp_depth: int = option(
        0,
        MODEL,
        help="llama / deepseek: DeepSeek-V3 multi-token prediction, D sequential modules "
        "(module k predicts the token k + 1 ahead, sharing the embedding and head; 0: off)",
        resume="refuse",
    )
    """DeepSeek-V3 multi-token prediction: D sequential modules after the model, module k predicting
    the token k + 1 ahead (``fastpar.models.mtp``; HF num_nextn_predict_layers). 0: off."""
    mtp_loss_coef: float = option(
        DEFAULT_COEF,
        MODEL,
        help="the MTP loss weight lambda: loss = main + lambda / D * sum of the depths' "
        "cross-entropies (Megatron's default; DeepSeek-V3 trained with 0.3, then 0.1)",
        resume="warn",
    )

    @property
    def ffn_size(self) -> int:
        """``ffn``, else 8·hidden/3 rounded up to a multiple of 64."""
        return self.ffn if self.ffn is not None else 64 * math.ceil(8 * self.hidden / 3 / 64)

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn if self.moe_ffn is not None else self.ffn_size
