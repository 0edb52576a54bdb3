"""Hugging Face model families: one record per ``config.model_type``, the one table every part
that treats a family specially reads (the TP plans, the MoE adapter, the pipeline split,
``--hf-config``, packed documents, the Llama conversion). Plain data, so a leaf; ``register``
adds a family and every consumer sees it (docs/contributing.md, "A new Hugging Face family").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

MASK_RULES = ("causal", "sliding_window", "layer_types")
"""How a decoder's forward builds its attention masks (``Family.masks``)."""


@dataclass(frozen=True)
class MoEBlock:
    """An HF MoE block ``fastpar.moe.moe_from_hf`` converts (fused experts ``gate_up_proj`` /
    ``down_proj``, router ``gate``)."""

    name: str
    """The adapter's name, recorded on the converted layer (``moe.hf_family``)."""
    classes: tuple[str, ...]
    """HF class names of the block (subclasses are recognised through their MRO)."""
    shared: str | None = None
    """Attribute of the block's dense shared expert MLP, if it has one."""
    shared_gate: str | None = None
    """Attribute of the sigmoid gate on the shared expert, if it has one."""
    shared_optional: bool = False
    """The shared expert may be absent (DeepSeek-V3 with ``n_shared_experts=0``)."""
    expert_bias: bool = False
    """The router carries a per-expert score bias (``gate.e_score_correction_bias``)."""
    score: str = "softmax"
    """The router's score function (``fastpar.moe`` ``score``): "softmax" or "sigmoid"."""
    normalize_topk: bool | None = None
    """Whether the top-k routing weights are renormalised; None: the gate's ``norm_topk_prob``
    says (its config's ``norm_topk_prob``)."""
    groups: bool = False
    """The router keeps the top-k within the best groups of experts: ``gate.num_group`` /
    ``gate.topk_group`` (config ``n_group`` / ``topk_group``), a group scored by its top-2."""
    scaling: bool = False
    """The routing weights are scaled by ``gate.routed_scaling_factor``."""
    jitter: bool = False
    """The block may hold a router jitter noise (``block.jitter_noise``, config
    ``router_jitter_noise``), which is refused unless 0."""
    router_dtype: bool = False
    """The block keeps its router weight in its own dtype (exported as the router holds it,
    not in the experts' dtype)."""
    hub_experts: tuple[str, tuple[str, str, str]] | None = None
    """The Hub's per-expert checkpoint layout, which transformers 5 still writes while the
    model holds the experts fused: (the block's name in a layer, the gate / up / down names:
    ``{block}.experts.E.{name}.weight``; a block not named "mlp" keeps its router there)."""


@dataclass(frozen=True)
class LlamaMoE:
    """How a family's config.json holds fastpar's Llama MoE fields (``fastpar.models.llama_hf``
    writes and reads them by these keys)."""

    title: str
    """The family as messages name it ("Mixtral")."""
    experts: tuple[str, ...]
    """Keys of the expert count: the first is written, any is read."""
    ffn: str
    """Key of each expert's width (``moe_ffn``)."""
    sparse_step: str | None = None
    """Key of the MoE-block step (``moe_every``); None: every block is a MoE block."""
    norm_topk: str | None = None
    """Key of ``norm_topk_prob``; None: the top-k weights are always renormalised."""
    fixed: Mapping[str, tuple[object, str]] = field(default_factory=dict)
    """Key -> (the value written, why another is refused): read, a truthy value is refused
    with the reason (fastpar has no sliding window, jitter or per-layer MoE list)."""


@dataclass(frozen=True)
class Family:
    """What fastpar knows of one HF family; None / False: that part does not support it."""

    model_type: str
    """``config.model_type``."""
    plan: Mapping[str, object] | None = None
    """Built-in TP plan template: pattern -> style, ``{b}`` the base model's prefix, "lm_head"
    the output embedding (``fastpar.nn.plans``)."""
    masks: str | None = None
    """Pipeline split by decoder layer (one of ``MASK_RULES``): the forward is exactly embed ->
    rotary -> layers -> norm -> lm_head (``fastpar.parallel.pipeline.hf``)."""
    documents: bool = False
    """A causal LM whose forward takes per-document positions (``fastpar.models.hf_documents``)."""
    llama_arch: str | None = None
    """The HF architecture fastpar's Llama converts to and from (``fastpar.models.llama_hf``)."""
    moe: MoEBlock | None = None
    """Its MoE block, if it has one."""
    qk_norm: bool = False
    """The attention has a per-head RMSNorm on q and k (``self_attn.q_norm`` / ``k_norm``)."""
    qkv_bias: bool = False
    """The q / k / v projections always carry a bias and o_proj none (no ``attention_bias``)."""
    llama_moe: LlamaMoE | None = None
    """With ``llama_arch``: how its config.json holds the Llama's MoE fields."""
    llama_fixed: Mapping[str, object] = field(default_factory=dict)
    """With ``llama_arch``: config.json keys written with these values (what the family would
    otherwise default to and fastpar's Llama does not compute)."""


_DECODER = {
    "{b}embed_tokens": "vocab",
    "{b}layers.*.self_attn.q_proj": "column",
    "{b}layers.*.self_attn.k_proj": "column",
    "{b}layers.*.self_attn.v_proj": "column",
    "{b}layers.*.self_attn.o_proj": "row",
    "{b}layers.*.mlp.gate_proj": "column",
    "{b}layers.*.mlp.up_proj": "column",
    "{b}layers.*.mlp.down_proj": "row",
    "lm_head": "lm_head",
}
_QK_NORM = {"{b}layers.*.self_attn.q_norm": "per_head", "{b}layers.*.self_attn.k_norm": "per_head"}
_EXPERTS = {"{b}layers.*.mlp": "experts"}
_SHARED_EXPERT = {
    "{b}layers.*.mlp.shared_expert.gate_proj": "column",
    "{b}layers.*.mlp.shared_expert.up_proj": "column",
    "{b}layers.*.mlp.shared_expert.down_proj": "row",
}
_MLA = {  # DeepSeek-V3's multi-head latent attention, split by heads
    "{b}layers.*.self_attn.q_proj": "column",  # q_lora_rank None
    "{b}layers.*.self_attn.q_a_proj": "replicate",  # its q_a_layernorm: whole too
    "{b}layers.*.self_attn.q_b_proj": "column",
    "{b}layers.*.self_attn.kv_a_proj_with_mqa": (
        "shared_key",
        {"features": "config.qk_rope_head_dim"},  # k_rot: read by every local head
    ),
    "{b}layers.*.self_attn.kv_b_proj": "column",
    "{b}layers.*.self_attn.o_proj": "row",
}
_DEEPSEEK_V3 = {
    "{b}embed_tokens": "vocab",
    **_MLA,
    "{b}layers.*.mlp.gate_proj": "column",  # the first_k_dense_replace dense layers
    "{b}layers.*.mlp.up_proj": "column",
    "{b}layers.*.mlp.down_proj": "row",
    "{b}layers.*.mlp": "experts",
    "{b}layers.*.mlp.shared_experts.gate_proj": "column",
    "{b}layers.*.mlp.shared_experts.up_proj": "column",
    "{b}layers.*.mlp.shared_experts.down_proj": "row",
    "lm_head": "lm_head",
}
_GPT2 = {
    "{b}wte": "vocab",
    "{b}h.*.attn.c_attn": ("column", {"fused": 3}),
    "{b}h.*.attn.c_proj": "row",
    "{b}h.*.mlp.c_fc": "column",
    "{b}h.*.mlp.c_proj": "row",
    "lm_head": "lm_head",
}
_BERT = {
    "{b}embeddings.word_embeddings": "vocab",
    "{b}encoder.layer.*.attention.self.query": "column",
    "{b}encoder.layer.*.attention.self.key": "column",
    "{b}encoder.layer.*.attention.self.value": "column",
    "{b}encoder.layer.*.attention.output.dense": "row",
    "{b}encoder.layer.*.intermediate.dense": "column",
    "{b}encoder.layer.*.output.dense": "row",
    "cls.predictions.decoder": "lm_head",
}

_HUB = ("mlp", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL_BLOCK = MoEBlock(
    "mixtral",
    ("MixtralSparseMoeBlock",),
    normalize_topk=True,
    jitter=True,
    hub_experts=("block_sparse_moe", ("w1", "w3", "w2")),
)
QWEN3_MOE_BLOCK = MoEBlock("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), hub_experts=_HUB)
QWEN2_MOE_BLOCK = MoEBlock(
    "qwen2_moe",
    ("Qwen2MoeSparseMoeBlock",),
    shared="shared_expert",
    shared_gate="shared_expert_gate",
    hub_experts=_HUB,
)
DEEPSEEK_V3_BLOCK = MoEBlock(
    "deepseek_v3",
    ("DeepseekV3MoE",),
    shared="shared_experts",
    shared_optional=True,
    expert_bias=True,
    score="sigmoid",
    groups=True,
    scaling=True,
    router_dtype=True,
    hub_experts=_HUB,
)
_QWEN3 = {**_DECODER, **_QK_NORM}
_NO_WINDOW = {"use_sliding_window": False, "sliding_window": None}

REGISTRY: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            _DECODER,
            "causal",
            True,
            "LlamaForCausalLM",
            llama_fixed={"attention_bias": False, "mlp_bias": False},
        ),
        Family("mistral", _DECODER, "sliding_window", True),
        Family(
            "qwen2",
            _DECODER,
            "layer_types",
            True,
            "Qwen2ForCausalLM",
            qkv_bias=True,
            llama_fixed=_NO_WINDOW,
        ),
        Family(
            "qwen3",
            _QWEN3,
            "layer_types",
            True,
            "Qwen3ForCausalLM",
            qk_norm=True,
            llama_fixed={**_NO_WINDOW, "attention_bias": False},
        ),
        Family(
            "mixtral",
            {**_DECODER, **_EXPERTS},
            "sliding_window",
            True,
            "MixtralForCausalLM",
            MIXTRAL_BLOCK,
            llama_moe=LlamaMoE(
                "Mixtral",
                ("num_local_experts",),
                "intermediate_size",
                fixed={
                    "sliding_window": (None, "attention is full (causal) only"),
                    "router_jitter_noise": (0.0, "fastpar's Llama MoE has no jitter"),
                },
            ),
        ),
        Family(
            "qwen2_moe",
            {**_DECODER, **_EXPERTS, **_SHARED_EXPERT},
            None,
            True,
            None,
            QWEN2_MOE_BLOCK,
        ),
        Family(
            "qwen3_moe",
            {**_QWEN3, **_EXPERTS},
            "sliding_window",
            True,
            "Qwen3MoeForCausalLM",
            QWEN3_MOE_BLOCK,
            qk_norm=True,
            llama_moe=LlamaMoE(
                "Qwen3-MoE",
                ("num_experts", "num_local_experts"),  # transformers 5 writes the alias
                "moe_intermediate_size",
                "decoder_sparse_step",
                "norm_topk_prob",
                fixed={
                    "mlp_only_layers": (
                        [],
                        "fastpar's Llama places its MoE blocks by decoder_sparse_step "
                        "(moe_every) alone",
                    )
                },
            ),
            llama_fixed={**_NO_WINDOW, "attention_bias": False},
        ),
        Family("deepseek_v3", _DEEPSEEK_V3, "causal", moe=DEEPSEEK_V3_BLOCK),
        Family("gpt2", _GPT2, documents=True),
        Family("bert", _BERT),
    )
}
"""model_type -> its record. Read it through ``get`` / ``find`` / ``names``; change it through
``register`` / ``unregister``."""

_FIELDS = tuple(f.name for f in fields(Family) if f.name != "model_type")


def register(family: Family, *, replace: bool = False) -> Family:
    """Add ``family`` (every consumer sees it at once); an existing model_type is refused
    unless ``replace``. Returns the record."""
    if not isinstance(family, Family):
        raise TypeError(f"register takes a fastpar.families.Family, got {type(family).__name__}")
    if family.masks is not None and family.masks not in MASK_RULES:
        raise ValueError(f"Family.masks must be one of {list(MASK_RULES)}, got {family.masks!r}")
    if family.model_type in REGISTRY and not replace:
        raise ValueError(
            f"family {family.model_type!r} is already registered; pass replace=True to change it"
        )
    REGISTRY[family.model_type] = family
    return family


def unregister(model_type: str) -> Family:
    """Remove a family; returns its record (ValueError naming the registered ones)."""
    family = get(model_type)
    del REGISTRY[model_type]
    return family


def find(model_type: str | None) -> Family | None:
    """The record of ``model_type``, or None."""
    return REGISTRY.get(model_type) if isinstance(model_type, str) else None


def get(model_type: str | None) -> Family:
    """The record of ``model_type``; ValueError naming the registered families."""
    family = find(model_type)
    if family is None:
        raise ValueError(
            f"unknown model family {model_type!r}; registered: {', '.join(sorted(REGISTRY))}"
        )
    return family


def names(supporting: str | None = None) -> tuple[str, ...]:
    """The registered model types, sorted; with ``supporting`` (a ``Family`` field: "plan",
    "masks", "documents", "llama_arch", "moe") only those whose field is set."""
    if supporting is None:
        return tuple(sorted(REGISTRY))
    if supporting not in _FIELDS:
        raise ValueError(f"supporting must be one of {list(_FIELDS)}, got {supporting!r}")
    return tuple(sorted(t for t, f in REGISTRY.items() if getattr(f, supporting)))


def moe_blocks() -> tuple[MoEBlock, ...]:
    """Every registered MoE block adapter, once each, by name."""
    found = {f.moe.name: f.moe for f in REGISTRY.values() if f.moe is not None}
    return tuple(found[n] for n in sorted(found))


def moe_block(cls: type) -> MoEBlock | None:
    """The adapter of an HF MoE block class (or any subclass), or None."""
    by_class = {c: b for b in moe_blocks() for c in b.classes}
    return next((by_class[k.__name__] for k in cls.__mro__ if k.__name__ in by_class), None)
