"""The training run's settings (``TrainConfig``: the flags' values and what follows from them),
its ``check`` (the rules of ``fastpar.train.config_checks`` in order), and ``config_from`` (the
parsed command line's values)."""

from __future__ import annotations

import argparse
import functools
import os
import typing
from dataclasses import dataclass, field, fields

from fastpar.cliutil import Flag, Option, declared_flags, lenient, nested_configs, option_of
from fastpar.data import index_file, tokenizer_eos_id, tokenizer_vocab_size
from fastpar.models import DeepSeekConfig, GPTConfig, LlamaConfig, native
from fastpar.models.llama import check_routing_values
from fastpar.moe.config import ROUTING_DEFAULTS
from fastpar.parallel.pipeline.recompute import RecomputePolicy
from fastpar.train.checks import _seconds as _seconds
from fastpar.train.checks import check_ranges, infer_dp, node_local_shard, torchrun_world_size
from fastpar.train.config_checks import (
    check_batch_split,
    check_compile,
    check_context_parallel,
    check_fused_ce_zero3,
    check_layout,
    check_model_flags,
    check_optimizer,
    check_outputs,
    check_packing,
    check_schedule,
    check_words,
)
from fastpar.train.memory import check_memory
from fastpar.train.options import ModelOptions, TrainOptions

DESCRIPTION = (
    "Train a GPT, a Llama or a Hugging Face model with DP x TP x PP x EP, ZeRO and mixed precision."
)


@dataclass
class TrainConfig(TrainOptions):
    """Everything a run needs: the trainer's flags (the fields of ``TrainOptions``, each with its
    help in its metadata, ``fastpar.train.options``) and ``model``, the native model's config,
    which holds the model's flags (``fastpar.models.native.model_flags``). Made from the flags'
    flat values by ``from_flags``; ``flags`` gives them back (train_config.json)."""

    model: GPTConfig | LlamaConfig | DeepSeekConfig | None = None
    """The config of --model (``GPTConfig``, ``LlamaConfig``, ``DeepSeekConfig``, or another
    registered model's: the model flags' values, the vocabulary ``vocab``); left out, the
    model flags at their defaults. None for an unknown --model (``check`` names it)."""
    other_model_flags: dict = field(default_factory=dict)
    """The model flags --model's config has no field for, given off their defaults (another
    model's options: ``check`` refuses them naming that model). With ``model`` left out, the
    model flags' values (flat names) its config is made of (``from_flags``)."""

    def __post_init__(self) -> None:
        # --recompute's policy: False (none), True (full: the engine's), or a selective one
        # ("attention", "mlp", "every:K"); the words "none" and "full" become the bools
        if isinstance(self.recompute, str) and self.recompute.strip().lower() in ("none", "full"):
            self.recompute = self.recompute.strip().lower() == "full"
        if self.init_from_hf and not self.hf_config:  # the model is the directory's
            self.hf_config = os.path.join(self.init_from_hf, "config.json")
        if self.model is None:  # --model's config, with this run's vocabulary
            try:
                vocab = self.vocab
            except (ValueError, ImportError, OSError):  # a bad --tokenizer: check names it
                vocab = 256
            self.model, self.other_model_flags = native.config_from_flags(
                self.model_type, self.other_model_flags, vocab_size=vocab
            )

    @classmethod
    def from_flags(cls, **values) -> TrainConfig:
        """The config of the flags' ``values`` by their flat names (``hidden=64``,
        ``experts=8``, ``untied=True``, ``router_score="sigmoid"``: the --config keys); a flag
        left out keeps its default. The one place the flat names meet the nested fields."""
        own, model = {f.name for f in _own_fields()}, native.model_flags()
        held = {f.name: f.path for f in _held_flags()}
        unknown = [k for k in values if k not in own and k not in model and k not in held]
        if unknown:
            raise TypeError(f"TrainConfig has no flag {unknown[0]!r}")
        configs = {}
        for holder, config in nested_configs(TrainConfig):
            kw = {p[1]: values[k] for k, p in held.items() if p[0] == holder and k in values}
            configs[holder] = lenient(config, **kw)
        mine = {k: v for k, v in values.items() if k in model}  # made into ``model``
        return cls(
            **{k: v for k, v in values.items() if k in own}, **configs, other_model_flags=mine
        )

    def flags(self) -> dict:
        """Every flag's value by its flat name, as ``from_flags`` takes them and
        train_config.json holds them, in ``flag_specs``' order: ``ModelOptions``', the model's,
        the rest of the trainer's own, then its nested configs'."""
        first = {f.name for f in fields(ModelOptions)}
        own = [f.name for f in _own_fields()]
        out = {name: getattr(self, name) for name in own if name in first}
        out.update(native.flags_of(self.model, self.other_model_flags))
        out.update({name: getattr(self, name) for name in own if name not in first})
        for f in _held_flags():
            out[f.name] = functools.reduce(getattr, f.path, self)
        return out

    def flag_items(self) -> list[tuple[str, Option, object]]:
        """(flat name, ``Option``, value) of every flag, in ``flag_specs``' order."""
        values = self.flags()
        return [(spec.name, spec.option, values[spec.name]) for spec in flag_specs()]

    def with_flags(self, **changes) -> TrainConfig:
        """This config with ``changes`` (flat names) to some flags."""
        return type(self).from_flags(**{**self.flags(), **changes})

    @property
    def recompute_policy(self) -> RecomputePolicy:
        """--recompute as a ``RecomputePolicy`` (ValueError naming a bad one)."""
        return RecomputePolicy.parse(self.recompute)

    @property
    def model_name(self) -> str:
        """What trains: "gpt", "llama", or "hf:<config path>"."""
        return f"hf:{self.hf_config}" if self.hf_config else self.model_type

    @property
    def schedule_label(self) -> str:
        """The schedule as the logs name it: "1f1b", "interleaved (v=2)", "interleaved (v=2,
        G=4)"."""
        parts = [f"v={self.virtual_stages}"] if self.virtual_stages > 1 else []
        parts += [f"G={self.microbatch_group_size}"] if self.microbatch_group_size else []
        return self.schedule + (f" ({', '.join(parts)})" if parts else "")

    @property
    def lr_floor(self) -> float:
        """Where the cosine schedule ends: --min-lr, else --lr / 10."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def vocab(self) -> int:
        """--vocab-size, else the --hf-config model's, else the tokenizer's, else 256 (bytes)."""
        if self.vocab_size is not None:
            return self.vocab_size
        if self.hf_config:
            from fastpar.models.hf import read_config_json

            return int(read_config_json(self.hf_config)["vocab_size"])
        return tokenizer_vocab_size(self.tokenizer) if self.tokenizer else 256

    @property
    def profile_window(self) -> tuple[int, int]:
        """(first, last) step --profile records, both included (1-based, as the log line
        counts): --profile-steps A:B, else every step."""
        if self.profile_steps is None:
            return 1, self.steps
        first, last = (int(v) for v in self.profile_steps.split(":"))
        return first, last

    @property
    def document_source(self) -> str | None:
        """Where this run's document boundaries come from (words for messages), or None: a
        .jsonl of records, an index beside a .bin (``X.idx``), --eos-id, or the --tokenizer's
        end-of-document token (``fastpar.data.tokenizer_eos_id``)."""
        if (self.data or "").endswith(".jsonl"):
            return f"the records of {self.data}"
        if (idx := index_file(self.data)) is not None:
            return f"the document index {idx}"
        if self.eos_id is not None:
            return f"--eos-id {self.eos_id}"
        if (eos := tokenizer_eos_id(self.tokenizer)) is not None:
            return f"the tokenizer's end-of-document token (id {eos})"
        return None

    @property
    def packs_documents(self) -> bool:
        """Whether rows are packed documents: --pack documents, or --pack left out where the
        data have document boundaries (``document_source``)."""
        if self.pack is not None:
            return self.pack == "documents"
        return self.document_source is not None

    def check(self) -> None:
        """Refuse an impossible run before any process group exists: one ValueError line naming
        the value and the fix (the data are checked by ``load_data``; the world size under
        torchrun by ``check_world_size``). Resolves --data-dtype left out for a .bin file
        (``fastpar.data.bin_dtype``)."""
        check_ranges(self)
        check_outputs(self)
        check_model_flags(self)
        if self.precision not in ("fp32", "bf16", "fp16", "fp8"):
            raise ValueError(f"precision must be fp32, bf16, fp16 or fp8, got {self.precision!r}")
        check_schedule(self)
        RecomputePolicy.parse(self.recompute)  # a bad --recompute: ValueError naming it
        check_layout(self)  # the mesh's own refusals (hybrid sharding among them)
        check_optimizer(self)
        check_context_parallel(self)
        check_fused_ce_zero3(self)
        check_packing(self)
        check_batch_split(self)
        check_compile(self)
        if not self.hf_config:  # the routing flags by their names, before their configs' own
            flags, model = self.flags(), self.model
            routing = {name: flags[name] for name in ROUTING_DEFAULTS}
            check_routing_values(routing, model.moe_every, model.num_experts, model.top_k)
            model.check(self.tp, self.pp, self.ep)
            check_memory(self)  # activations that clearly do not fit this machine
        check_words(self)


def config_from(args: argparse.Namespace, world: int | None = None) -> TrainConfig:
    """The TrainConfig of parsed flags. ``world``: the job's world size (default: torchrun's
    WORLD_SIZE, None when self-started); --dp left out is --dp-shard x --dp-replicate when both
    are given, else ``world / (tp * cp * pp)`` under torchrun, else 2. Never raises: ``TrainConfig.check`` and ``check_world_size`` judge the result."""
    values = {spec.name: getattr(args, spec.name) for spec in flag_specs()}
    if values["ep"] is None:  # the default: expert parallelism for fastpar's MoE models only
        values["ep"] = 1 if values["hf_config"] or values["init_from_hf"] else TrainConfig.ep
    shard, replicate = values.get("dp_shard"), values.get("dp_replicate")
    if values["dp"] is None and shard and replicate:  # any two of dp, S, R give the third
        values["dp"] = shard * replicate
    if values["dp"] is None:
        world = torchrun_world_size() if world is None else world
        tp_cp = values["tp"] * (values.get("cp") or 1)  # dp = world / (tp * cp * pp)
        values["dp"] = infer_dp(tp_cp, values["pp"], world, TrainConfig.dp)
    return TrainConfig.from_flags(**node_local_shard(values))  # multi-node: shard in a node


# -- the flags: the trainer's own fields and the model configs' ------------------------------
def _own_fields() -> list:
    """TrainConfig's fields that are flags (``option``): all but ``model``,
    ``other_model_flags`` and the nested configs."""
    return [f for f in fields(TrainConfig) if option_of(f) is not None]


def _held_flags() -> list[Flag]:
    """The flags TrainConfig's nested configs declare (``OptimizerConfig.name`` is
    ``--optimizer``), their paths from TrainConfig."""
    return [f for h, c in nested_configs(TrainConfig) for f in declared_flags(c, (h,))]


def flag_specs() -> list[Flag]:
    """Every flag of ``python -m fastpar.train``: ``ModelOptions``' (--model, --hf-config,
    ...), the registered model configs' (``fastpar.models.native.model_flags``), the rest of
    ``TrainOptions``', then the nested configs'."""
    defaults, hints = TrainConfig(), typing.get_type_hints(TrainConfig)
    own = [
        Flag(f.name, option_of(f), getattr(defaults, f.name), hints[f.name], (f.name,))
        for f in _own_fields()
    ]
    first = {f.name for f in fields(ModelOptions)}
    model = list(native.model_flags().values())
    return (
        [s for s in own if s.name in first]
        + model
        + [s for s in own if s.name not in first]
        + _held_flags()
    )
