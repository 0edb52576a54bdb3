"""The training run's settings (``TrainConfig``: the flags' values and what follows from them),
its ``check`` (the rules of ``fastpar.train.config_checks`` in order), and ``config_from`` (the
parsed command line's values)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields

from fastpar.data import index_file, tokenizer_eos_id, tokenizer_vocab_size
from fastpar.models import native
from fastpar.models.llama import check_routing_values, routed
from fastpar.models.shape import DecoderShape
from fastpar.moe.config import ROUTING_DEFAULTS
from fastpar.parallel.pipeline.recompute import RecomputePolicy
from fastpar.train.checks import _seconds as _seconds
from fastpar.train.checks import (
    check_ranges,
    infer_dp,
    node_local_shard,
    torchrun_world_size,
)
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
from fastpar.train.options import TrainOptions

DESCRIPTION = (
    "Train a GPT, a Llama or a Hugging Face model with DP x TP x PP x EP, ZeRO and mixed precision."
)


@dataclass
class TrainConfig(TrainOptions):
    """Everything a run needs (the CLI's flags: the fields of ``TrainOptions``, each with its
    help in its metadata, ``fastpar.train.options``)."""

    def __post_init__(self) -> None:
        # --recompute's policy: False (none), True (full: the engine's), or a selective one
        # ("attention", "mlp", "every:K"); the words "none" and "full" become the bools
        if isinstance(self.recompute, str) and self.recompute.strip().lower() in ("none", "full"):
            self.recompute = self.recompute.strip().lower() == "full"
        if self.init_from_hf and not self.hf_config:  # the model is the directory's
            self.hf_config = os.path.join(self.init_from_hf, "config.json")
        if self.moe_every is None:  # DeepSeek: MoE in every block after the dense ones
            model = native.REGISTRY.get(self.model_type)  # (an unknown one is refused later)
            self.moe_every = model.moe_every if model is not None else 2

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

    def nested_values(self, config: type) -> dict:
        """``moe_router`` / ``moe_experts`` as fastpar's model has them (its expert kind, its
        top-k normalisation); an --hf-config run: the flags' values only."""
        if self.hf_config:
            return {}
        return dataclasses.asdict(getattr(self.model(), config.nested))

    def model(self):
        """The native model's config (``fastpar.models.native``): ``DecoderShape``'s fields
        from the flags of the same name (``--experts``, ``--untied`` and the vocabulary under
        theirs), the routing flags, and the model's own (``NativeModel.kwargs``)."""
        model = native.get(self.model_type)
        renamed = {"num_experts": self.experts, "tie_embeddings": not self.untied}
        renamed["vocab_size"] = self.vocab
        shape = {
            f.name: getattr(self, f.name) for f in fields(DecoderShape) if f.name not in renamed
        }
        return routed(
            model.config,
            **shape,
            **renamed,
            **{name: getattr(self, name) for name in ROUTING_DEFAULTS},
            **model.kwargs(self),
        )

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
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        check_schedule(self)
        RecomputePolicy.parse(self.recompute)  # a bad --recompute: ValueError naming it
        check_layout(self)  # the mesh's own refusals (hybrid sharding among them)
        check_optimizer(self)
        check_context_parallel(self)
        check_fused_ce_zero3(self)
        check_packing(self)
        check_batch_split(self)
        check_compile(self)
        if not self.hf_config:  # the routing flags by their names, before their configs exist
            routing = {name: getattr(self, name) for name in ROUTING_DEFAULTS}
            check_routing_values(routing, self.moe_every, self.experts, self.top_k)
            self.model().check(self.tp, self.pp, self.ep)
            check_memory(self)  # activations that clearly do not fit this machine
        check_words(self)


def config_from(args: argparse.Namespace, world: int | None = None) -> TrainConfig:
    """The TrainConfig of parsed flags. ``world``: the job's world size (default: torchrun's
    WORLD_SIZE, None when self-started); --dp left out is --dp-shard x --dp-replicate when both
    are given, else ``world / (tp * cp * pp)`` under torchrun, else 2. Never raises: ``TrainConfig.check`` and ``check_world_size`` judge the result."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if values["ep"] is None:  # the default: expert parallelism for fastpar's MoE models only
        values["ep"] = 1 if values["hf_config"] or values["init_from_hf"] else TrainConfig.ep
    shard, replicate = values.get("dp_shard"), values.get("dp_replicate")
    if values["dp"] is None and shard and replicate:  # any two of dp, S, R give the third
        values["dp"] = shard * replicate
    if values["dp"] is None:
        world = torchrun_world_size() if world is None else world
        tp_cp = values["tp"] * (values.get("cp") or 1)  # dp = world / (tp * cp * pp)
        values["dp"] = infer_dp(tp_cp, values["pp"], world, TrainConfig.dp)
    return TrainConfig(**node_local_shard(values))  # multi-node torchrun: shard in a node
