"""The Hugging Face config of a fastpar GPT (``python -m fastpar.export`` writes this file into
the exported directory; ``AutoConfig.from_pretrained(dir, trust_remote_code=True)`` reads it).

Self-contained: torch and transformers only, no fastpar. The fields are the training run's
model options (``fastpar.train.TrainConfig``) that decide the function the model computes.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class FastparGPTConfig(PretrainedConfig):
    """A fastpar ``--model gpt``: learned positions, pre-norm blocks (RMSNorm or LayerNorm),
    fused q|k|v attention without biases, GELU MLPs with biases, and every ``moe_every``-th
    block a mixture of GELU experts (top-k of a softmax or sigmoid score, optionally biased
    selection, group-limited, scaled, with a shared expert)."""

    model_type = "fastpar_gpt"
    # the names transformers' generic code asks for
    attribute_map = {  # noqa: RUF012 (a class attribute transformers reads)
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "n_positions",
    }

    def __init__(
        self,
        vocab_size: int = 256,
        n_positions: int = 64,
        n_embd: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_inner: int | None = None,
        norm: str = "rmsnorm",
        norm_eps: float | None = None,
        moe_every: int = 0,
        num_experts: int = 4,
        num_experts_per_tok: int = 2,
        moe_inner: int | None = None,
        router_score: str = "softmax",
        normalize_topk: bool | None = None,
        routed_scaling_factor: float | None = None,
        router_groups: int | None = None,
        router_group_topk: int | None = None,
        group_score_topk: int | None = None,
        expert_bias: bool = False,
        shared_expert_ffn: int | None = None,
        shared_expert_gate: bool = False,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        if norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {norm!r}")
        if router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"router_score must be 'softmax' or 'sigmoid', got {router_score!r}")
        self.vocab_size, self.n_positions = vocab_size, n_positions
        self.n_embd, self.n_layer, self.n_head = n_embd, n_layer, n_head
        self.n_inner = 4 * n_embd if n_inner is None else n_inner
        self.norm = norm
        self.norm_eps = (1e-6 if norm == "rmsnorm" else 1e-5) if norm_eps is None else norm_eps
        self.moe_every, self.num_experts = moe_every, num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_inner = self.n_inner if moe_inner is None else moe_inner
        self.router_score = router_score
        self.normalize_topk = num_experts_per_tok > 1 if normalize_topk is None else normalize_topk
        self.routed_scaling_factor = routed_scaling_factor
        self.router_groups, self.router_group_topk = router_groups, router_group_topk
        if router_groups is not None and group_score_topk is None:
            group_score_topk = min(2, num_experts // router_groups)
        self.group_score_topk = group_score_topk
        self.expert_bias = expert_bias
        self.shared_expert_ffn, self.shared_expert_gate = shared_expert_ffn, shared_expert_gate
        # the model computes the whole prefix each step: no key/value cache
        kwargs.setdefault("use_cache", False)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
