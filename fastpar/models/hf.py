"""Hugging Face models for ``fastpar.train --hf-config`` and ``fastpar.verify --hf-config``.

    config = load_config("config.json")                   # any family with a built-in plan
    parts = hf_blocks(config, mesh)                        # parallelized, split into blocks
    stage, (start, _) = build_stage(parts.blocks, mesh.pp_size, mesh.pp_rank)

What is built: docs/hf.md ("Training an HF model"). transformers is imported when needed.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fastpar import families
from fastpar.checkpoint.format import CheckpointError
from fastpar.checkpoint.hf import load_hf
from fastpar.checkpoint.hf._common import _short
from fastpar.checkpoint.hf.load import _read_into, _weight_map
from fastpar.cliutil import read_table
from fastpar.mesh.groups import ParallelMesh
from fastpar.models import hf_documents
from fastpar.nn import parallelize
from fastpar.nn.plan import match, parse_style
from fastpar.nn.plans import supported
from fastpar.nn.styles import STYLES, listing
from fastpar.parallel.pipeline import hf as pipe


def decoders() -> tuple[str, ...]:
    """Families the pipeline helper splits by layer (``fastpar.parallel.pipeline.hf``)."""
    return families.names("masks")


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("--hf-config needs transformers: pip install 'fastpar[hf]'") from exc
    return transformers


def read_config_json(path: str) -> dict:
    """The JSON of a config file, with a clear error for a missing file or bad JSON."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--hf-config {path!r}: cannot read a JSON config ({exc})") from exc
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"--hf-config {path!r} has no 'model_type' (say \"llama\")")
    return raw


def load_config(path: str):
    """The transformers config a ``config.json`` describes."""
    raw = read_config_json(path)
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    config = _transformers().AutoConfig.for_model(raw["model_type"], **kwargs)
    if "architectures" in raw:
        config.architectures = raw["architectures"]
    return config


def model_class(config):
    """The class of ``config.architectures[0]``; else the family's masked LM for an encoder
    (BERT: it has one and ``is_decoder`` is False), else its causal LM."""
    transformers = _transformers()
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is not None:
        return cls
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    masked = MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(config.model_type)
    if masked and not getattr(config, "is_decoder", False):
        return getattr(transformers, masked)
    return transformers.AutoModelForCausalLM


def is_masked_lm(config) -> bool:
    return model_class(config).__name__.endswith("ForMaskedLM")


def build(config) -> nn.Module:
    """The dense model of ``config`` (random init from the current random stream), in fp32."""
    cls = model_class(config)
    return (cls.from_config(config) if hasattr(cls, "from_config") else cls(config)).float()


def model_builder(path: str) -> Callable[[], nn.Module]:
    """A zero-argument builder of the (dense, random-init) model of a ``config.json``."""
    config = load_config(path)
    return lambda: build(config)


class WholeModel(nn.Module):
    """One pipeline block holding the whole model: token ids [B, T] -> logits [B, T, V(/tp)]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_cache": False} if not is_masked_lm(self.model.config) else {}
        position_ids = hf_documents.positions(self.model.config, ids)  # None: no documents
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        return self.model(input_ids=ids, **kwargs).logits


@dataclass
class HFParts:
    """``blocks`` (pipeline blocks), ``block_types`` (ZeRO-3's units), ``vocab_size``,
    ``masked`` (a masked LM), ``names(stage)`` (this stage's parameters under HF names) and
    ``tie(blocks, mesh)`` (call after build_stage and the dtype cast; returns the tied copy)."""

    blocks: list[nn.Module]
    block_types: tuple[type, ...]
    vocab_size: int
    masked: bool
    names: Callable[[nn.Module], dict[str, nn.Parameter]]
    tie: Callable[[list[nn.Module], object], nn.Parameter | None]
    mask_id: int = -1

    def buffers(self, stage: nn.Module) -> dict[str, torch.Tensor]:
        """This stage's persistent buffers under HF names (DeepSeek-V3's router
        ``gate.e_score_correction_bias``): what checkpoints keep beside the parameters."""
        return persistent_buffers(stage)


_BLOCKS = (pipe.HFEmbedding, pipe.HFDecoderLayer, pipe.HFHead)


def persistent_buffers(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers (not parameters) of the HF blocks in ``stage``, by HF name."""
    params = {id(p) for p in stage.parameters()}
    out: dict[str, torch.Tensor] = {}
    for block in stage.modules():  # a virtual stage's chunks hold the blocks one level down
        if isinstance(block, (WholeModel, *_BLOCKS)):
            module = block.model if isinstance(block, WholeModel) else block
            for key, t in module.state_dict(keep_vars=True).items():
                if id(t) not in params:
                    out.setdefault(key, t)
    return out


def plan_hint() -> str:
    """What a refusal for a missing plan suggests, listing the styles ``STYLES`` holds now."""
    return (
        f"pass --plan FILE: a TOML or JSON table of module-name pattern -> style ({listing()}; "
        f"or [style, {{options}}]), as fastpar.parallelize takes"
    )


def has_builtin_plan(config) -> bool:
    """Whether ``config``'s family has a built-in tensor-parallel plan (``fastpar.nn.plans``)."""
    family = families.find(config.model_type)
    return family is not None and family.plan is not None


def moe_families() -> tuple[str, ...]:
    """Families whose MoE blocks the "experts" style converts (experts over EP: ``--ep``)."""
    return families.names("moe")


def has_moe_block(config) -> bool:
    """Whether ``config``'s family has an MoE block fastpar converts (``fastpar.moe.hf``)."""
    family = families.find(config.model_type)
    return family is not None and family.moe is not None


def read_plan(path: str) -> dict:
    """The plan of a ``--plan`` file (.toml or .json): a table of pattern -> style, or a table
    with a ``plan`` table in it. ValueError naming the file and the fix."""
    raw = read_table(path, "--plan", "module pattern -> style")
    if isinstance(raw.get("plan"), dict):
        raw = raw["plan"]
    if not raw:
        raise ValueError(f"--plan {path}: the file must hold a table of module pattern -> style")
    plan = {}
    for pattern, style in raw.items():
        style = tuple(style) if isinstance(style, list) else style
        try:
            if not (isinstance(style, str) or (len(style) == 2 and isinstance(style[1], dict))):
                raise ValueError(f"plan[{pattern!r}] = {style!r}: a style or [style, {{options}}]")
            parse_style(pattern, style)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--plan {path}: {exc}") from exc
        plan[pattern] = style
    return plan


def check_plan(config, plan: dict, path: str) -> None:
    """Every pattern of ``plan`` names modules of ``config``'s model (built on the meta device:
    no memory, no init), and its LM head is planned "column". ValueError naming the fix."""
    with torch.device("meta"):
        model = build(copy.deepcopy(config))
    names = [n for n, _ in model.named_modules() if n]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            near = difflib.get_close_matches(pattern, names, n=1, cutoff=0.5)
            hint = f"; the nearest module is {near[0]!r}" if near else ""
            raise ValueError(
                f"--plan {path}: pattern {pattern!r} matches no module of "
                f"{type(model).__name__}{hint} (the names of model.named_modules())"
            )
    match(model, plan, strict=True)
    _lm_head_split(model, plan, path)


def _lm_head_split(model: nn.Module, plan: dict, path: str) -> dict:
    """``plan`` with its LM head's entries as the trainer needs them: "column", the logits left
    split over the vocabulary (padded), for the vocab-parallel cross-entropy."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = next((n for n, m in model.named_modules() if m is head), None) if head else None
    if name is None:
        return plan
    out, planned = dict(plan), False
    for pattern, style in plan.items():
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        kind, kwargs = (style, {}) if isinstance(style, str) else style
        record = STYLES.get(kind)
        if record is None or record.vocab_logits is None:
            able = " or ".join(f'"{s.name}"' for s in STYLES.values() if s.vocab_logits)
            raise ValueError(
                f"--plan {path}: the LM head {name!r} is planned {kind!r}: plan it {able} "
                "(the trainer keeps its logits split over the vocabulary)"
            )
        out[pattern], planned = (kind, {**kwargs, **record.vocab_logits}), True
    if not planned:
        raise ValueError(
            f'--plan {path}: no entry for the LM head {name!r}: add "{name}" = "column" '
            "(the trainer's loss is the vocab-parallel cross-entropy)"
        )
    return out


def hf_blocks(
    config, mesh: ParallelMesh | None, plan: dict | None = None, plan_path: str = ""
) -> HFParts:
    """Build, parallelize and cut the model of ``config`` for this rank's mesh (a copy of
    ``config``: the model's attention is switched to the documents-aware one, the caller's
    config is left as it was). ``plan``: a ``--plan`` file's plan (``read_plan``) instead of
    the family's built-in one; its LM head's logits stay split over the vocabulary."""
    config = copy.deepcopy(config)
    model = build(config)
    if mesh is not None and (plan is not None or mesh.tp_size > 1 or has_builtin_plan(config)):
        if plan is not None:
            plan = _lm_head_split(model, plan, plan_path)
        elif not has_builtin_plan(config):
            raise ValueError(
                f"--hf-config: no built-in plan for model_type {config.model_type!r} (built-in: "
                f"{supported()}); {plan_hint()}"
            )
        model = parallelize(model, plan, mesh=mesh, loss_parallel=True)
    # (tp 1 without a plan: nothing to split; data, pipeline and ZeRO parallelism need none)
    vocab = int(config.vocab_size)
    masked = is_masked_lm(config)
    if config.model_type in decoders() and not masked:
        blocks = pipe.hf_decoder_blocks(model)
        blocks[0] = hf_documents.DocumentsHFEmbedding(model, blocks[0].mask_kinds)
        hf_documents.enable(model)  # attention that reads the documents context
        return HFParts(
            blocks,
            (type(blocks[1]),),
            vocab,
            masked,
            names=lambda stage: dict(pipe.hf_named_parameters(stage)),
            tie=pipe.hf_tie_across_stages,
        )
    if mesh is not None and mesh.pp_size > 1:
        raise ValueError(
            f"--pp {mesh.pp_size} with a {config.model_type} model: pipeline stages split the "
            f"decoder families {list(decoders())} only; use --pp 1"
        )
    if not masked:
        hf_documents.enable(model)
    layers = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    units = (type(max(layers, key=len)[0]),) if layers else ()
    return HFParts(
        [WholeModel(model)],
        units,
        vocab,
        masked,
        names=lambda stage: dict(next(iter(stage)).model.named_parameters()),
        tie=lambda blocks, mesh: None,
        mask_id=mask_token_id(config),
    )


def check_documents(config) -> None:
    """Raise a ValueError (naming the family and the fix) if an ``--hf-config`` model of
    ``config`` cannot train on packed documents exactly (``fastpar.models.hf_documents``)."""
    hf_documents.check(config)


def masked_lm_batch(x: torch.Tensor, step: int, seed: int, mask_id: int, fraction: float = 0.15):
    """BERT-style masked LM on token rows ``x`` [B, T]: the same number of positions in every
    row (so replicas and micro-batches average alike) become ``mask_id``; the targets hold the
    original ids there and -100 elsewhere."""
    g = torch.Generator().manual_seed(seed * 7_919 + step)
    rows, seq = x.shape
    k = max(1, round(fraction * seq))
    pos = torch.rand(rows, seq, generator=g).argsort(dim=1)[:, :k]
    inputs, targets = x.clone(), torch.full_like(x, -100)
    targets.scatter_(1, pos, x.gather(1, pos))
    inputs.scatter_(1, pos, mask_id)
    return inputs, targets


def mask_token_id(config) -> int:
    """``config.mask_token_id`` if set, else the last id of the vocabulary."""
    value = getattr(config, "mask_token_id", None)
    return int(value) if isinstance(value, int) else int(config.vocab_size) - 1


def _per_expert_patterns() -> list[tuple[re.Pattern, str, int]]:
    """transformers 5 ``save_pretrained`` writes MoE experts in the Hub's per-expert layout
    (each block adapter's ``hub_experts``: Mixtral ``block_sparse_moe.experts.E.w1|w3|w2``,
    Qwen3-MoE ``mlp.experts.E.gate_proj|up_proj|down_proj``) while the models hold them fused:
    (pattern, fused name, part)."""
    out = []
    for block, names in sorted({b.hub_experts for b in families.moe_blocks() if b.hub_experts}):
        where = re.escape(block)
        for name, fused, part in zip(
            names, ("gate_up_proj", "gate_up_proj", "down_proj"), (0, 1, 0), strict=True
        ):
            key = rf"(.*){where}\.experts\.(\d+)\.{re.escape(name)}\.weight$"
            out.append((re.compile(key), f"mlp.experts.{fused}", part))
        if block != "mlp":  # the router under another block name
            out.append((re.compile(rf"(.*){where}\.gate\.weight$()"), "mlp.gate.weight", 0))
    return out


def _fused(key: str) -> tuple[str, int, int] | None:
    """(the fused model name, its part, the expert) a per-expert file key goes into, or None."""
    for pattern, name, part in _per_expert_patterns():
        m = pattern.match(key)
        if m:
            return m.group(1) + name, part, int(m.group(2) or 0)
    return None


def _per_expert(name: str, wmap: dict[str, str]) -> torch.Tensor | None:
    """The fused tensor ``name`` assembled from its per-expert keys (read whole), or None."""
    from safetensors import safe_open

    parts: dict[tuple[int, int], torch.Tensor] = {}
    for key, file in wmap.items():
        hit = _fused(key)
        if hit is not None and hit[0] == name:
            with safe_open(file, framework="pt") as f:
                parts[hit[2], hit[1]] = f.get_tensor(key)
    if not parts:
        return None
    if name.endswith("mlp.gate.weight"):
        return parts[0, 0]
    # gate_up_proj [E, 2F, H]: gate rows, then up; down_proj [E, H, F]
    rows = {e: sorted(k for x, k in parts if x == e) for e in sorted({e for e, _ in parts})}
    return torch.stack([torch.cat([parts[e, k] for k in ks]) for e, ks in rows.items()])


def load_pretrained(parts: HFParts, stage: nn.Module, directory: str):
    """Fill this rank's ``stage`` (built by ``hf_blocks``, cut by ``build_stage``) with the
    weights of a ``save_pretrained`` directory, each rank reading only its slices
    (``fastpar.checkpoint.load_hf``: no collective). A weight tied to the word embedding (the
    LM head) is read under the embedding's name. Raises ``CheckpointError`` naming the tensors
    this stage lacks in the files, or file tensors no block of the model claims (another model).
    Returns the ``LoadStats``."""
    embed = {id(p): name for name, p in parts.names([parts.blocks[0]]).items()}
    targets = {embed.get(id(p), name): p for name, p in parts.names(stage).items()}
    wmap = _weight_map(directory)
    # persistent buffers too (DeepSeek-V3's router score bias: else it would stay zero)
    targets.update({k: t for k, t in persistent_buffers(stage).items() if k in wmap})
    stats = load_hf(targets, directory, strict=False)
    for name in list(stats.missing):  # MoE experts saved one by one
        full = _per_expert(name, wmap)
        if full is not None:
            with torch.no_grad():
                stats.bytes_read += _read_into(targets[name], full)
            stats.missing.remove(name)
            stats.loaded.append(name)
    if stats.missing:
        raise CheckpointError(
            f"--init-from-hf {directory}: {len(stats.missing)} tensors of the model are absent "
            f"from its safetensors: {_short(stats.missing)}; is it the model of its config.json?"
        )
    claimed: set[str] = set()
    for block in parts.blocks:  # every block's names, tied aliases too (state_dict keeps them)
        module = block.model if isinstance(block, WholeModel) else block
        claimed.update(module.state_dict(keep_vars=True))
    unexpected = [k for k in wmap if k not in claimed and (_fused(k) or ("",))[0] not in claimed]
    if unexpected:
        raise CheckpointError(
            f"--init-from-hf {directory} holds {len(unexpected)} tensors the model of its "
            f"config.json has no place for: {_short(unexpected)}"
        )
    return stats
