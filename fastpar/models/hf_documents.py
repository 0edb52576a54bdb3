"""Packed documents (``fastpar.models.documents``) for Hugging Face causal LMs: an attention
registered with transformers (``enable(model)``, which ``hf_blocks`` does) that stops at documents
while a ``Documents`` context is current, and runs exactly as before outside one. How, with
``positions(config, ids)``, and what is refused: docs/packing.md ("Hugging Face models on
documents")."""

from __future__ import annotations

import sys

import torch

from fastpar import families as _families
from fastpar.models.documents import current
from fastpar.ops.documents import document_attention
from fastpar.parallel.pipeline import hf as pipe

ATTENTION = "fastpar_documents"
"""The attention implementation whose fallback (no documents current) is HF's SDPA."""
ATTENTION_EAGER = "fastpar_documents_eager"
"""The attention implementation whose fallback is the family's eager attention."""
_BASES = {ATTENTION: "sdpa", ATTENTION_EAGER: "eager"}
_NAMES = {base: name for name, base in _BASES.items()}


def families() -> tuple[str, ...]:
    """Causal LM families whose forward takes ``position_ids`` for every position-dependent
    part (rotary embeddings; GPT-2's learned ``wpe``) and whose attention goes through
    ``AttentionInterface`` (their records' ``documents``, ``fastpar.families``)."""
    return _families.names("documents")


_CP_MESSAGE = "HF models with packed documents under --cp > 1 are not supported"
_REGISTERED: list = []
_EAGER: dict = {}  # module class -> its modeling file's eager_attention_forward


def register() -> None:
    """Register the two attention implementations and their mask functions with transformers
    (once; idempotent)."""
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in _BASES:
        AttentionInterface.register(name, _attention)
        AttentionMaskInterface.register(name, _mask)
    _REGISTERED.append(True)


def unsupported(config) -> str | None:
    """Why a model of ``config`` cannot run packed documents exactly (None: it can)."""
    family = getattr(config, "model_type", None)
    if family == "bert" or getattr(config, "is_encoder_decoder", False):
        return (
            f"packed documents with a {family} model: it is not a causal LM (its attention is "
            f"bidirectional); use a causal family ({', '.join(families())}) or --pack stream"
        )
    if family not in families():
        return (
            f"packed documents with a {family} model are not supported: its forward was not "
            f"checked to take per-document positions; use one of {', '.join(families())} or "
            "--pack stream"
        )
    layer_types = getattr(config, "layer_types", None)
    sliding = (
        "sliding_attention" in layer_types
        if layer_types is not None
        else bool(getattr(config, "sliding_window", None))
    )
    if sliding:
        return (
            f"packed documents with a {family} model using sliding-window attention "
            f"(sliding_window={getattr(config, 'sliding_window', None)}): the document "
            'attention is full causal within each document; set "sliding_window": null (and '
            '"use_sliding_window": false) in the config, or use --pack stream'
        )
    if family == "gpt2" and getattr(config, "add_cross_attention", False):
        return "packed documents with a gpt2 model with cross-attention are not supported"
    return None


def check(config) -> None:
    """Raise a ValueError if a model of ``config`` cannot run packed documents exactly."""
    reason = unsupported(config)
    if reason is not None:
        raise ValueError(reason)


def enable(model) -> bool:
    """Switch ``model`` to the documents-aware attention (its fallback: the implementation it
    had, "sdpa" or "eager"); returns whether it was switched. A model left as it was (another
    implementation, a family outside ``families()``, GPT-2's ``reorder_and_upcast_attn`` eager
    path) refuses documents at its forward (``positions``)."""
    config = model.config
    base = getattr(config, "_attn_implementation", None)
    if base in _BASES:
        return True
    if base not in _NAMES or getattr(config, "model_type", None) not in families():
        return False
    if base == "eager" and getattr(config, "reorder_and_upcast_attn", False):
        return False  # GPT-2 takes that path only under the name "eager"
    register()
    for m in model.modules():  # each module class's eager attention, looked up once here
        module = sys.modules.get(type(m).__module__)
        if hasattr(module, "eager_attention_forward"):
            _EAGER.setdefault(type(m), module.eager_attention_forward)
    config._attn_implementation = _NAMES[base]
    return True


def positions(config, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The ``position_ids`` [B, S] of the current documents for rows ``input_ids`` [B, S]
    (positions restarting at each document, or the row's with ``reset_positions=False``), on
    the ids' device; None when no documents are current. Refuses what cannot run exactly."""
    docs = current()
    if docs is None:
        return None
    check(config)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _BASES:
        raise ValueError(
            f"packed documents with a {config.model_type} model running attn_implementation="
            f"{impl!r}: the attention would not stop at documents; build it through "
            "fastpar.models.hf.hf_blocks (or call fastpar.models.hf_documents.enable(model)) "
            'with attn_implementation "sdpa" or "eager"'
        )
    _check_rows(docs.ids, tuple(input_ids.shape[:2]))
    return docs.positions().to(input_ids.device)


def _check_rows(ids: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(ids.shape) == shape:
        return
    if ids.shape[0] == shape[0] and ids.shape[1] > shape[1]:
        raise ValueError(
            f"{_CP_MESSAGE}: the documents cover {ids.shape[1]} positions per row but the model "
            f"sees {shape[1]} (a context-parallel chunk); use --cp 1"
        )
    raise ValueError(
        f"the current documents are {tuple(ids.shape)} but the model's rows are {shape}: enter "
        "documents(...) with the doc ids of the rows being run"
    )


def _mask(**kwargs):
    """The mask function of both names: None with documents current (the attention needs
    none), else the fallback's mask from the same arguments."""
    if current() is not None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = _BASES[kwargs["config"]._attn_implementation]
    return ALL_MASK_ATTENTION_FUNCTIONS[base](**kwargs)


def _fallback(module, base: str):
    if base == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    eager = _EAGER.get(type(module))
    if eager is None:
        raise ValueError(
            f"{type(module).__name__} has no eager_attention_forward in its module: use "
            'attn_implementation "sdpa"'
        )
    return eager


def _attention(module, query, key, value, attention_mask, **kwargs):
    """HF's attention-function signature: q [B, Hq, S, D], k / v [B, Hkv, S, D] ->
    (out [B, S, Hq, D], None). Documents current: attention within them; else the fallback."""
    docs = current()
    if docs is None:
        base = _BASES[module.config._attn_implementation]
        return _fallback(module, base)(module, query, key, value, attention_mask, **kwargs)
    family = getattr(module.config, "model_type", type(module).__name__)
    refused = {
        "sliding_window": 'sliding-window attention: set "sliding_window": null in the config',
        "softcap": "soft-capped attention scores",
        "s_aux": "attention sinks",
    }
    for key_, why in refused.items():
        if kwargs.get(key_) not in (None, 0):
            raise ValueError(f"packed documents with a {family} model using {why}")
    if kwargs.get("dropout", 0.0):
        raise ValueError(
            f"packed documents with a {family} model with attention dropout "
            f"{kwargs['dropout']}: set it to 0 in the config"
        )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(f"packed documents with a {family} model: its attention is not causal")
    b, _, s, _ = query.shape
    if key.shape[2] != s:
        raise ValueError(
            f"packed documents with a {family} model: keys of length {key.shape[2]} for "
            f"queries of length {s} (a KV cache?); training runs only"
        )
    _check_rows(docs.ids, (b, s))
    out = document_attention(query, key, value, docs.ids.to(query.device), kwargs.get("scaling"))
    return out.transpose(1, 2).contiguous(), None


class DocumentsHFEmbedding(pipe.HFEmbedding):
    """The pipeline embedding block (``fastpar.parallel.pipeline.hf.HFEmbedding``); with
    documents current it gives per-document position ids (and the rotary cos / sin of them) and
    builds no masks (the messages carry None where the masks were)."""

    def forward(self, inputs) -> tuple:
        if current() is None:
            return super().forward(inputs)
        input_ids, attention_mask = pipe._split_inputs(inputs)
        if attention_mask is not None:
            raise ValueError(
                "packed documents with a padding attention_mask are not supported: the "
                "documents say which tokens attend to which; pass input_ids only"
            )
        position_ids = positions(self.config, input_ids)
        embed_tokens, rotary_emb = self._parts
        hidden = embed_tokens(input_ids)
        cos, sin = rotary_emb(hidden, position_ids)
        return (hidden, cos, sin, position_ids, *([None] * len(self.mask_kinds)))
