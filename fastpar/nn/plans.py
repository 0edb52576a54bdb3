"""Built-in tensor-parallel plans for Hugging Face model families, chosen by the model's class.

``fastpar.parallelize(model, mesh=mesh)`` with no plan looks the model up here by its
``config.model_type`` (so ``LlamaForCausalLM``, ``LlamaModel`` and ``LlamaForSequenceClassification``
share one plan) and writes the patterns relative to the base model (``model.`` for a causal LM,
none for the bare ``LlamaModel``). Entries of a built-in plan may match nothing (a Mixtral has no
dense MLP; a bare ``BertModel`` has no MLM head); a user's plan may not.

Every family splits attention by heads (q, k, v "column", the output projection "row"), dense
MLPs by their hidden width, the token embedding by vocabulary rows, and the LM head by vocabulary
rows with the logits gathered (so Hugging Face's own loss and ``generate()`` work unchanged), or
left split with ``loss_parallel=True`` for ``fastpar.nn.functional.vocab_parallel_cross_entropy``.
Per-head norms (Qwen3's ``q_norm`` / ``k_norm``) are "per_head": replicated, their gradient
all-reduced over TP. Mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) are "experts":
fastpar's MoE under HF's names, each expert's FFN split over TP, experts over the mesh's EP group
(``fastpar.moe.hf_block``); Qwen2-MoE's shared expert is split like a dense MLP.
"""

from __future__ import annotations

from torch import nn

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
_QK_NORM = {
    "{b}layers.*.self_attn.q_norm": "per_head",
    "{b}layers.*.self_attn.k_norm": "per_head",
}
_EXPERTS = {"{b}layers.*.mlp": "experts"}
_SHARED_EXPERT = {
    "{b}layers.*.mlp.shared_expert.gate_proj": "column",
    "{b}layers.*.mlp.shared_expert.up_proj": "column",
    "{b}layers.*.mlp.shared_expert.down_proj": "row",
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

#: config.model_type -> plan template ("{b}" is the base model's prefix)
FAMILIES: dict[str, dict] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": {**_DECODER, **_QK_NORM},
    "mixtral": {**_DECODER, **_EXPERTS},
    "qwen2_moe": {**_DECODER, **_EXPERTS, **_SHARED_EXPERT},
    "qwen3_moe": {**_DECODER, **_QK_NORM, **_EXPERTS},
    "gpt2": _GPT2,
    "bert": _BERT,
}


def model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def builtin_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, object] | None:
    """The built-in plan for ``model``'s family (see ``FAMILIES``), or None if there is none."""
    template = FAMILIES.get(model_type(model) or "")
    if template is None:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    head = ("column", {"pad_output": True, "gather_output": not loss_parallel})
    plan: dict[str, object] = {}
    for pattern, style in template.items():
        plan[pattern.format(b=base)] = head if style == "lm_head" else style
    return plan


def supported() -> str:
    return ", ".join(sorted(FAMILIES))
