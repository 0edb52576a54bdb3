"""What fastpar's decoder blocks keep for backward, in bytes per token on one rank: the tensors
autograd saves (each storage once, parameters not counted), counted from the model's shapes.
``GPTConfig.activation_bytes`` / ``LlamaConfig.activation_bytes`` give every kind of block as
``Activations``, from the pieces here; ``mtp_bytes`` a multi-token prediction module's.

Counted as the blocks run (torch's CPU and GPU kernels alike): an RMSNorm keeps its input in
fp32 (an upcast copy below fp32), its per-token 1 / rms in fp32 and its normalised output in the
run's dtype; a LayerNorm its input and per-token mean and 1 / rms; the linear layer after a norm
its input (the whole sequence, gathered, under sequence parallelism); the fused attention kernel
its q, k, v, output (the output projection's input is a view of it) and per-head log-sum-exp in
fp32, not the scores. Not counted: RoPE's cos / sin (per position, not per token), the
router's indices and probabilities beyond one index and weight a routed copy, and anything a
backward allocates (gradients, the split backward's stored output gradients).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Activations:
    """Bytes per token on one rank that each kind of pipeline block keeps for backward: the
    embedding, a dense and a MoE decoder block, the head with its loss (``head``, and
    ``head_fixed`` bytes once a micro-batch: not per token)."""

    embedding: float
    dense: float
    moe: float
    head: float
    head_fixed: float = 0.0


def norm_bytes(kind: str, width: int, size: int) -> float:
    """One token's saved bytes of a norm over ``width`` values (``size``: bytes of an element of
    the run's dtype)."""
    if kind == "layernorm":
        return size * width + 2 * size  # input, mean and 1 / rms
    return 4 * width + 4 + size * width  # fp32 input, fp32 1 / rms, normalised output


def block_bytes(
    cfg,
    tp: int,
    sp: int,
    size: int,
    *,
    attention: float,
    mlp: int,
    expert_ffn: int,
    norm: str = "rmsnorm",
) -> tuple[float, float]:
    """(dense, MoE) bytes per token of a pre-norm block: two norms (over the sequence split
    ``sp`` ways) and the linear input after each, ``attention`` elements of the attention
    (q, k, v and output, over ``tp``) plus its per-head log-sum-exp, and the MLP's ``mlp``
    activations per unit of width (``cfg.ffn_size``), or, for a MoE block, each routed copy's
    token, its ``mlp`` per unit of ``expert_ffn`` and its output (a shared expert on every
    token)."""
    h = cfg.hidden
    base = 2 * (norm_bytes(norm, h, size) / sp + size * h)
    base += size * attention / tp + 4 * cfg.heads / tp
    dense = base + size * mlp * cfg.ffn_size / tp
    # dropless routing sends every token to top_k experts (each keeps the token's copy, its
    # hidden activations and its output, with its index and weight); with a capacity some
    # tokens may be dropped
    routed = cfg.top_k if cfg.capacity_factor is None else 0
    moe = base + routed * (size * (2 * h + mlp * expert_ffn / tp) + 12)
    if cfg.shared_expert_ffn is not None:  # a dense FFN on every token, not split
        moe += size * (mlp * cfg.shared_expert_ffn + h)
    return dense, moe


def activations(
    cfg, tp: int, sp: int, size: int, fused_ce: bool, norm: str = "rmsnorm", **block
) -> Activations:
    """Every block's bytes (``Activations``): ``block_bytes(cfg, ..., **block)`` for the
    decoder blocks; the embedding keeps its int64 token ids; the head its final norm and that
    norm's output, then the logits in fp32 with two fp32 statistics and the int64 target a
    token (vocab-parallel cross-entropy), or with ``fused_ce`` (linear cross-entropy, its
    gradients computed in forward) the head weight's gradient in fp32 once a micro-batch."""
    dense, moe = block_bytes(cfg, tp, sp, size, norm=norm, **block)
    h, vocab = cfg.hidden, cfg.vocab_size / tp
    head = norm_bytes(norm, h, size) / sp + size * h
    if fused_ce:
        return Activations(8.0, dense, moe, head, 4 * vocab * h)
    return Activations(8.0, dense, moe, head + 4 * vocab + 16)


def mtp_bytes(cfg, act: Activations, block: float, sp: int, size: int) -> float:
    """One multi-token prediction module's bytes per token (``fastpar.models.mtp``), counted by
    the rules of the blocks ``act`` holds: its lookup of the tokens ahead (the embedding's
    ids), its two input norms (over the sequence split ``sp`` ways) and eh_proj's input (their
    outputs side by side, 2·hidden), its decoder block (``block``: ``act.dense`` or
    ``act.moe``), then its own final norm and the shared head's logits with their loss, as the
    head's (``act.head``; a fused cross-entropy's ``head_fixed`` is once a module too)."""
    h = cfg.hidden
    return (
        act.embedding
        + 2 * norm_bytes("rmsnorm", h, size) / sp
        + 2 * size * h / sp
        + block
        + act.head
    )
