"""Built-in tensor-parallel plans for Hugging Face model families, chosen by the model's class.

``fastpar.parallelize(model, mesh=mesh)`` with no plan looks the model up in ``fastpar.families``
by its ``config.model_type`` (so ``LlamaForCausalLM``, ``LlamaModel`` and
``LlamaForSequenceClassification`` share one plan) and writes the patterns relative to the base model (``model.`` for a causal LM,
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

from fastpar import families


def model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def builtin_plan(model: nn.Module, *, loss_parallel: bool = False) -> dict[str, object] | None:
    """The built-in plan for ``model``'s family (``fastpar.families``), or None if there is
    none."""
    family = families.find(model_type(model))
    template = None if family is None else family.plan
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
    """The families with a built-in plan, comma-separated."""
    return ", ".join(families.names("plan"))
