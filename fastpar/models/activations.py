"""What fastpar's decoder blocks keep for backward, in bytes per token on one rank: the tensors
autograd saves (each storage once, parameters not counted), counted from the model's shapes.
``GPTConfig.activation_bytes`` / ``LlamaConfig.activation_bytes`` give every kind of block as
``Activations``, from the pieces here; ``mtp_bytes`` a multi-token prediction module's. What is
counted and what is not: docs/training.md ("The activation memory estimate").
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
    #: a split backward's stored output gradients a token, from B until W (``block_grads``)
    dense_grads: float = 0.0
    moe_grads: float = 0.0
    head_grads: float = 0.0


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
    """(dense, MoE) bytes per token of a pre-norm block: two norms (over the sequence split ``sp``
    ways) and the linear input after each, ``attention`` elements of the attention (q, k, v and
    output, over ``tp``) plus its per-head log-sum-exp, and the MLP's ``mlp`` activations per unit
    of width (``cfg.ffn_size``), or, for a MoE block, each routed copy's token, its ``mlp`` per unit
    of ``expert_ffn`` and its output (a shared expert on every token)."""
    h = cfg.hidden
    base = 2 * (norm_bytes(norm, h, size) / sp + size * h)
    base += size * attention / tp + 4 * cfg.heads / tp
    dense = base + size * mlp * cfg.ffn_size / tp
    # dropless routing sends every token to top_k experts (each keeps the token's copy, its
    # hidden activations and its output, with its index and weight); with a capacity some
    # tokens may be dropped
    routed = cfg.top_k if cfg.capacity_factor is None else 0
    moe = base + routed * (size * (2 * h + mlp * expert_ffn / tp) + 12)
    shared = cfg.moe_experts.shared_ffn_hidden_size
    if shared is not None:  # a dense FFN on every token, not split
        moe += size * (mlp * shared + h)
    return dense, moe


def block_grads(
    cfg, tp: int, sp: int, size: int, *, attention: float, mlp_in: int, expert_ffn: int
) -> tuple[float, float]:
    """(dense, MoE) bytes per token of the output gradients a split backward keeps for W in a
    pre-norm block: the two norms' outputs (over the sequence split ``sp`` ways), the
    attention's ``attention`` elements of weight-taking outputs (its input projections and
    per-head norms, over ``tp``) and its output projection's (whole: the partial sums before
    the reduction), then the MLP's input projection (``mlp_in`` units of ``cfg.ffn_size``:
    2 gated, 1 not) and output; for a MoE block the router's scores and, a routed copy, the
    expert's two products (a shared expert's, and its gate's, on every token)."""
    h = cfg.hidden
    base = 2 * h / sp + attention / tp + h
    dense = base + mlp_in * cfg.ffn_size / tp + h
    routed = cfg.top_k if cfg.capacity_factor is None else 0
    moe = base + cfg.num_experts / sp + routed * (mlp_in * expert_ffn / tp + h)
    shared = cfg.moe_experts.shared_ffn_hidden_size
    if shared is not None:
        moe += mlp_in * shared + h + (1 if cfg.moe_experts.shared_gate else 0)
    return size * dense, size * moe


def swiglu_activations(
    cfg, tp: int, sp: int, size: int, fused_ce: bool, attention: float, attention_grads: float
) -> Activations:
    """``activations`` of a block of RMSNorm, ``attention`` values saved a token and a SwiGLU
    MLP (the Llama's, the DeepSeek's): gate|up, SiLU and product saved, the gradients of the
    MLP's two inputs stored for W; ``attention_grads``: the attention's stored gradients."""
    return activations(
        cfg,
        tp,
        sp,
        size,
        fused_ce,
        attention=attention,
        mlp=4,
        expert_ffn=cfg.moe_ffn_size,
        attention_grads=attention_grads,
        mlp_in=2,
    )


def activations(
    cfg,
    tp: int,
    sp: int,
    size: int,
    fused_ce: bool,
    norm: str = "rmsnorm",
    *,
    attention_grads: float = 0.0,
    mlp_in: int = 1,
    **block,
) -> Activations:
    """Every block's bytes (``Activations``): ``block_bytes(cfg, ..., **block)`` for the
    decoder blocks; the embedding keeps its int64 token ids; the head its final norm and that
    norm's output, then the logits in fp32 with two fp32 statistics and the int64 target a
    token (vocab-parallel cross-entropy), or with ``fused_ce`` (linear cross-entropy, its
    gradients computed in forward) the head weight's gradient in fp32 once a micro-batch.
    The stored output gradients: ``block_grads(cfg, ..., attention=attention_grads,
    mlp_in=mlp_in)``; the head's final norm output (the logits' gradient overwrites the saved
    logits: the trainer's cross-entropy runs ``inplace_backward``)."""
    dense, moe = block_bytes(cfg, tp, sp, size, norm=norm, **block)
    dense_g, moe_g = block_grads(
        cfg, tp, sp, size, attention=attention_grads, mlp_in=mlp_in, expert_ffn=block["expert_ffn"]
    )
    h, vocab = cfg.hidden, cfg.vocab_size / tp
    head = norm_bytes(norm, h, size) / sp + size * h
    grads = dict(dense_grads=dense_g, moe_grads=moe_g, head_grads=size * h / sp)
    if fused_ce:
        return Activations(8.0, dense, moe, head, 4 * vocab * h, **grads)
    return Activations(8.0, dense, moe, head + 4 * vocab + 16, **grads)


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


def mtp_grads(cfg, act: Activations, block: float, sp: int, size: int) -> float:
    """One multi-token prediction module's stored output gradients a token (``block_grads``):
    its two input norms' outputs side by side (the concatenation's gradient, which theirs
    are views of), eh_proj's output (over the sequence split ``sp`` ways), its block's
    (``block``: ``act.dense_grads`` or ``act.moe_grads``) and the head's (``act.head_grads``)."""
    return size * 3 * cfg.hidden / sp + block + act.head_grads
