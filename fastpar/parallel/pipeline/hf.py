"""Pipeline blocks for Hugging Face causal-LM decoders (Llama, Mistral, Mixtral, Qwen2, Qwen3,
Qwen3-MoE), without glue code: ``hf_decoder_blocks`` gives [embedding, layer x N, head] for
``build_stage``. The blocks' messages, an example and what is refused: docs/pipelines.md
("Hugging Face decoders").
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fastpar import families
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_replicated, mark_sharded, mark_tied_copy, param_layout
from fastpar.parallel.data.protocols import DataParallel
from fastpar.parallel.pipeline.engine import tie_across_stages

# each family's record (fastpar.families) says which masks its model forward builds (its
# ``masks``): "causal" (one causal mask for every layer), "sliding_window" (one mask for every
# layer: sliding if config.sliding_window is set), or "layer_types" (a mask per kind in
# config.layer_types). Each family's forward was read to be exactly: embed -> rotary -> layers
# -> norm -> lm_head; a family that does more (Gemma scales its embeddings, say) would be
# silently wrong, so only the families with a ``masks`` rule are accepted.
_ATTENTION = ("eager", "sdpa")
_MASK_KINDS = ("full_attention", "sliding_attention")
_NEEDS = (
    "config",
    "model.embed_tokens",
    "model.layers",
    "model.norm",
    "model.rotary_emb",
    "lm_head",
)


def _mount(block: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at the dotted ``path`` inside ``block`` (plain containers made as
    needed), so the block's parameter names are the HF model's."""
    *parents, leaf = path.split(".")
    node = block
    for name in parents:
        if name not in node._modules:
            node.add_module(name, nn.Module())
        node = node._modules[name]
    node.add_module(leaf, module)


class HFEmbedding(nn.Module):
    """input_ids [B, T] or (input_ids, attention_mask [B, T]) ->
    (hidden [B, T, H], cos, sin [1, T, head_dim], position_ids [1, T], *masks)."""

    def __init__(self, model: nn.Module, mask_kinds: list[str]) -> None:
        super().__init__()
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        builders = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        self.config, self.mask_kinds = model.config, list(mask_kinds)
        self._builders = [builders[k] for k in self.mask_kinds]
        # no KV cache, ever; the argument was renamed past_key_values -> cache within 5.x
        params = inspect.signature(create_causal_mask).parameters
        self._no_cache = {"cache" if "cache" in params else "past_key_values": None}
        self._parts = (model.model.embed_tokens, model.model.rotary_emb)
        _mount(self, "model.embed_tokens", model.model.embed_tokens)
        _mount(self, "model.rotary_emb", model.model.rotary_emb)

    def forward(self, inputs) -> tuple:
        input_ids, attention_mask = _split_inputs(inputs)
        embed_tokens, rotary_emb = self._parts
        hidden = embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=hidden.device).unsqueeze(0)
        masks = []
        for kind, build in zip(self.mask_kinds, self._builders, strict=True):
            mask = build(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **self._no_cache,
            )
            if mask is not None and not isinstance(mask, torch.Tensor):
                raise TypeError(
                    f"transformers built a {type(mask).__name__} for the {kind} mask; pipeline "
                    f"messages carry tensors only: use attn_implementation in {_ATTENTION}"
                )
            masks.append(mask)
        cos, sin = rotary_emb(hidden, position_ids)
        return (hidden, cos, sin, position_ids, *masks)


class HFDecoderLayer(nn.Module):
    """(hidden, cos, sin, position_ids, *masks) -> the same, hidden through HF decoder layer
    ``index`` (given its mask slot)."""

    def __init__(self, layer: nn.Module, index: int, mask_slot: int) -> None:
        super().__init__()
        self.index, self.mask_slot = index, mask_slot
        self._layer = (layer,)
        _mount(self, f"model.layers.{index}", layer)

    def forward(self, msg: tuple) -> tuple:
        hidden, cos, sin, position_ids, *masks = msg
        hidden = self._layer[0](
            hidden,
            attention_mask=masks[self.mask_slot],
            position_ids=position_ids,
            position_embeddings=(cos, sin),
        )
        return (hidden, cos, sin, position_ids, *masks)


class HFHead(nn.Module):
    """(hidden, ...) -> logits [B, T, vocab]: the final norm and ``lm_head``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._parts = (model.model.norm, model.lm_head)
        _mount(self, "model.norm", model.model.norm)
        _mount(self, "lm_head", model.lm_head)
        # a weight tied to the embedding: distributed runs need hf_tie_across_stages first
        self.tie_pending = model.lm_head.weight is model.model.embed_tokens.weight

    def forward(self, msg: tuple) -> torch.Tensor:
        if self.tie_pending and dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "this model's lm_head is tied to its embedding (tie_word_embeddings=True): call "
                "hf_tie_across_stages(blocks, mesh) on every rank after build_stage, else the "
                "first and last pipeline stages train two separate copies of the weight"
            )
        norm, lm_head = self._parts
        return lm_head(norm(msg[0]))


def _split_inputs(inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple | list) or len(inputs) not in (1, 2):
        got = f"{len(inputs)} items" if isinstance(inputs, tuple | list) else type(inputs).__name__
        raise TypeError(
            "the embedding block takes input_ids [batch, seq] or (input_ids, attention_mask), "
            f"got {got}"
        )
    input_ids = inputs[0]
    mask = inputs[1] if len(inputs) == 2 else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point():
        raise TypeError(
            "the embedding block takes token ids (an integer tensor [batch, seq]); inputs_embeds "
            f"are not supported, got {getattr(input_ids, 'dtype', type(input_ids).__name__)}"
        )
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape):
        raise ValueError(
            "attention_mask must be a 2D padding mask shaped like input_ids "
            f"{tuple(input_ids.shape)} (1 = token, 0 = padding), got "
            f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}; "
            "4D and custom masks are not carried through the pipeline"
        )
    return input_ids, mask


def _mask_plan(config, num_layers: int) -> tuple[list[str], list[int]]:
    """The mask kinds the model's forward builds, and each layer's slot among them."""
    rule = families.get(config.model_type).masks
    if rule == "causal":
        return ["full_attention"], [0] * num_layers
    if rule == "sliding_window":
        kind = "full_attention" if config.sliding_window is None else "sliding_attention"
        return [kind], [0] * num_layers
    types = list(config.layer_types[:num_layers])
    for i, t in enumerate(types):
        if t not in _MASK_KINDS:
            raise ValueError(
                f"layer {i} of the {config.model_type} model has layer type {t!r}; the pipeline "
                f"blocks support {list(_MASK_KINDS)}"
            )
    kinds = ["full_attention"] + (["sliding_attention"] if "sliding_attention" in types else [])
    return kinds, [kinds.index(t) for t in types]


def _check_model(model: nn.Module) -> None:
    name = type(model).__name__
    for path in _NEEDS:
        obj = model
        for part in path.split("."):
            if not hasattr(obj, part):
                raise AttributeError(
                    f"{name} cannot be split into pipeline blocks: it has no attribute {path!r} "
                    f"(hf_decoder_blocks needs a Hugging Face causal LM with {', '.join(_NEEDS)})"
                )
            obj = getattr(obj, part)
    config = model.config
    model_type = getattr(config, "model_type", None)
    family = families.find(model_type)
    if family is None or family.masks is None:
        raise ValueError(
            f"{name} (model_type {model_type!r}) is not a supported decoder family; supported: "
            f"{list(families.names('masks'))}. Each family's forward must be exactly embed -> "
            "rotary -> layers -> norm -> lm_head (others, e.g. Gemma's scaled embeddings, would "
            "be wrong)"
        )
    attn = getattr(config, "_attn_implementation", None)
    if attn not in _ATTENTION:
        raise ValueError(
            f"{name} uses attn_implementation={attn!r}; the pipeline blocks carry tensor masks "
            f"only: build the model with attn_implementation in {_ATTENTION}"
        )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{name} has output_router_logits=True: the router's auxiliary loss is not carried "
            "through the pipeline; set config.output_router_logits=False"
        )


def hf_decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """``model`` (a Hugging Face causal LM) as pipeline blocks:
    ``[HFEmbedding, HFDecoderLayer x config.num_hidden_layers, HFHead]``. The blocks share the
    model's modules (no copy): call after ``fastpar.parallelize``, and split with
    ``build_stage(blocks, pp, rank)``; a pp above ``len(blocks)`` is an error there."""
    _check_model(model)
    config = model.config
    layers = list(model.model.layers)[: config.num_hidden_layers]
    kinds, slots = _mask_plan(config, len(layers))
    return [
        HFEmbedding(model, kinds),
        *(
            HFDecoderLayer(layer, i, slot)
            for i, (layer, slot) in enumerate(zip(layers, slots, strict=True))
        ),
        HFHead(model),
    ]


def hf_named_parameters(blocks: Iterable[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of a stage (or any blocks from ``hf_decoder_blocks``) under the HF
    model's own names, e.g. ``model.layers.3.self_attn.q_proj.weight``. A weight shared by two
    blocks of the stage is listed once, under its first name (as ``model.named_parameters()``
    does); the last stage's copy of a tied embedding is ``lm_head.weight`` (which checkpoints
    save and load as ``model.embed_tokens.weight``: see ``hf_tie_across_stages``)."""
    seen: set[int] = set()
    if isinstance(blocks, DataParallel) and blocks.module is not None:  # a wrapped stage
        blocks = blocks.module
    for block in blocks:
        if not isinstance(block, HFEmbedding | HFDecoderLayer | HFHead):
            raise TypeError(
                f"hf_named_parameters takes blocks from hf_decoder_blocks, got "
                f"{type(block).__name__}"
            )
        for name, p in block.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p


def hf_tie_across_stages(blocks: list[nn.Module], mesh: ParallelMesh | None) -> nn.Parameter | None:
    """Tied word embeddings (``lm_head.weight is model.embed_tokens.weight``) with pp > 1: the
    last stage's head gets its own copy of the weight (the same TP layout mark), and both ends
    are tied with ``tie_across_stages`` (marked duplicated over the embedding group, the copy set
    from the first stage). Returns the tied parameter this rank holds — pass it as
    ``PipelineEngine(..., tied=[p])`` for a plain optimizer — or None (untied, pp = 1, or a
    middle stage). Call on every rank, once, after ``build_stage``. The copy is marked as the
    embedding's (``fastpar.mesh.placement.mark_tied_copy``): a checkpoint holds one
    ``model.embed_tokens.weight`` whatever the pipeline layout."""

    embed, head = blocks[0], blocks[-1]
    if not isinstance(embed, HFEmbedding) or not isinstance(head, HFHead):
        raise TypeError("hf_tie_across_stages takes the full block list from hf_decoder_blocks")
    weight, lm_head = embed._parts[0].weight, head._parts[1]
    head.tie_pending = False
    if lm_head.weight is not weight or mesh is None or mesh.pp_size == 1:
        return None
    if mesh.is_first_stage:
        tied = weight
    elif mesh.is_last_stage:
        tied = nn.Parameter(weight.detach().clone())
        layout = param_layout(weight)
        if layout is not None and layout.kind == "sharded":
            mark_sharded(tied, layout.dim, layout.group, layout.full_size, layout.fused)
        elif layout is not None:
            mark_replicated(tied, layout.group)
        mark_tied_copy(tied, next(n for n, q in embed.named_parameters() if q is weight))
        lm_head.weight = tied
    else:
        return None
    tie_across_stages(tied, mesh)
    return tied
