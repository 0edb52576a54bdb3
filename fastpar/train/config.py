"""The training run's settings (``TrainConfig``), their checks before any rank starts, and the
command line that fills them."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, fields

from fastpar.data import (
    BIN_DTYPES,
    bin_dtype,
    index_file,
    tokenizer_eos_id,
    tokenizer_vocab_size,
)
from fastpar.models import native
from fastpar.models.shape import DecoderShape
from fastpar.moe.config import ROUTING_DEFAULTS
from fastpar.parallel.pipeline.recompute import RecomputePolicy
from fastpar.parallel.pipeline.schedules import SCHEDULES, chunked_names, make_schedule
from fastpar.train.checks import _seconds as _seconds
from fastpar.train.checks import (
    check_ranges,
    flag,
    infer_dp,
    node_local_shard,
    torchrun_world_size,
)
from fastpar.train.config_checks import (
    check_context_parallel,
    check_init_from_hf,
    check_layout,
    check_optimizer,
    check_packing,
    check_words,
    schedule_refusal,
)
from fastpar.train.memory import check_memory
from fastpar.train.options import TrainOptions

DESCRIPTION = (
    "Train a GPT, a Llama or a Hugging Face model with DP x TP x PP x EP, ZeRO and mixed precision."
)


_NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}


def _first_changed(cfg, defaults, names) -> str | None:
    """The first of ``names`` whose value in ``cfg`` is not the one in ``defaults`` (or None)."""
    return next((n for n in names if getattr(cfg, n) != getattr(defaults, n)), None)


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
        return model.config(
            **shape,
            **renamed,
            **{name: getattr(self, name) for name in ROUTING_DEFAULTS},
            **model.kwargs(self),
        )

    def _check_model_flags(self) -> None:
        model = native.get(self.model_type)  # (a ValueError naming the models)
        defaults = TrainConfig()
        if self.init_from_hf:
            check_init_from_hf(self)
        if self.hf_config:
            self._check_hf(defaults)
            return self._check_data_flags()
        foreign = [n for n in native.own_flags() if n not in model.flags]  # others' own flags
        name = _first_changed(self, defaults, foreign)
        if name is not None:
            takes = native.owners(name)
            whose = " and ".join(m.label for m in takes)
            raise ValueError(
                f"{flag(name)} is a {whose} option: add --model "
                + " or --model ".join(m.name for m in takes)
            )
        if self.norm not in model.norms:
            norms = [m.label for m in native.REGISTRY.values() if self.norm in m.norms]
            uses = " or ".join(_NORMS.get(n, n) for n in model.norms)
            raise ValueError(
                f"--norm {self.norm} is a {' and '.join(norms)} option: the {model.label} uses {uses}"
            )
        self._check_data_flags()

    def _check_data_flags(self) -> None:
        if self.data_dtype is not None and self.data_dtype not in BIN_DTYPES:
            raise ValueError(
                f"data_dtype must be one of {sorted(BIN_DTYPES)} (the ids of a .bin file), "
                f"got {self.data_dtype!r}"
            )
        if self.tokenizer and self.vocab_size is not None:
            n = tokenizer_vocab_size(self.tokenizer)
            if self.vocab_size < n:
                raise ValueError(
                    f"--vocab-size {self.vocab_size} is smaller than the {n} tokens of "
                    f"{self.tokenizer}: drop --vocab-size (it follows the tokenizer) or pass "
                    f">= {n}"
                )
        if (self.data or "").endswith(".bin"):  # resolved here: checkpoints record it
            if not os.path.isfile(self.data):  # before its dtype: no file, no dtype to choose
                raise ValueError(f"data file {self.data!r} does not exist")
            self.data_dtype = bin_dtype(self.data_dtype, self.vocab, self.data)

    def _check_hf(self, defaults: TrainConfig) -> None:
        """--hf-config: the model is the config's; fastpar-model flags do not apply."""
        from fastpar.models.hf import (
            decoders,
            has_moe_block,
            is_masked_lm,
            load_config,
            moe_families,
        )

        own = (
            "model_type",
            *("hidden", "heads", "layers", "rope_theta", "norm", "experts", "top_k", "ffn"),
            "untied",
            *native.own_flags(),
            *ROUTING_DEFAULTS,
        )
        name = _first_changed(self, defaults, own)
        if name is None and self.moe_every not in (0, defaults.moe_every):
            name = "moe_every"  # 0 (no fastpar MoE block) says nothing about the config's
        if name is not None:
            raise ValueError(
                f"{flag(name)} does not apply with --hf-config (the config sets the model)"
            )
        if self.sequence_parallel:
            raise ValueError("--sequence-parallel is not supported with --hf-config")
        if self.fused_ce:
            raise ValueError("--fused-ce needs fastpar's models (--model gpt / llama)")
        if self.cp > 1:
            raise ValueError(
                f"--cp {self.cp} with --hf-config: a Hugging Face model's own attention sees "
                "only its chunk of the sequence; context parallelism needs fastpar's models "
                "(--model gpt / llama), use --cp 1"
            )
        config = load_config(self.hf_config)
        self._check_plan(config)
        if self.ep > 1 and not has_moe_block(config):
            raise ValueError(
                f"--ep {self.ep} with --hf-config: a {config.model_type} model has no MoE block "
                f"whose experts could split over EP (the families with one: "
                f"{', '.join(moe_families())}); use --ep 1"
            )
        if self.vocab_size is not None and self.vocab_size != config.vocab_size:
            raise ValueError(
                f"--vocab-size {self.vocab_size} differs from the config's vocab_size "
                f"{config.vocab_size}: drop --vocab-size"
            )
        if self.tokenizer and tokenizer_vocab_size(self.tokenizer) > config.vocab_size:
            raise ValueError(
                f"{self.tokenizer} has {tokenizer_vocab_size(self.tokenizer)} tokens, more than "
                f"the config's vocab_size {config.vocab_size}: use a matching tokenizer"
            )
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        if isinstance(limit, int) and self.seq_len > limit:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the config's {limit} positions")
        for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
            heads = getattr(config, key, None)
            if isinstance(heads, int) and heads % self.tp:
                raise ValueError(
                    f"--tp {self.tp} does not divide the config's {key}={heads}: use a TP size "
                    f"that divides it"
                )
        if self.pp > 1 and (config.model_type not in decoders() or is_masked_lm(config)):
            raise ValueError(
                f"--pp {self.pp} with a {config.model_type} model: pipeline stages split the "
                f"decoder families {list(decoders())}; use --pp 1"
            )
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
        if self.pp > layers + 2:
            raise ValueError(
                f"--pp {self.pp} exceeds the {layers + 2} pipeline blocks of the model"
            )

    def _check_plan(self, config) -> None:
        """--plan FILE: it reads as a plan whose patterns name the model's modules; without
        it, at tp > 1 the family must have a built-in plan."""
        from fastpar.models.hf import check_plan, has_builtin_plan, plan_hint, read_plan

        if self.plan:
            check_plan(config, read_plan(self.plan), self.plan)
        elif not has_builtin_plan(config) and self.tp > 1:  # tp 1: nothing to split
            from fastpar.nn.plans import supported

            raise ValueError(
                f"--hf-config {self.hf_config}: model_type {config.model_type!r} has no built-in "
                f"tensor-parallel plan (built-in: {supported()}); {plan_hint()}"
            )

    @property
    def profile_window(self) -> tuple[int, int]:
        """(first, last) step --profile records, both included (1-based, as the log line
        counts): --profile-steps A:B, else every step."""
        if self.profile_steps is None:
            return 1, self.steps
        first, last = (int(v) for v in self.profile_steps.split(":"))
        return first, last

    def _check_outputs(self) -> None:
        """--profile-steps, --metrics-file and --tensorboard."""
        if self.profile_steps is not None:
            what = f"--profile-steps {self.profile_steps!r}"
            if not self.profile:
                raise ValueError(f"{what} needs --profile DIR (where the traces go): add it")
            parts = self.profile_steps.split(":")
            if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"{what} must be A:B, two step numbers (e.g. 3:5)")
            first, last = self.profile_window
            if not 1 <= first <= last <= self.steps:
                raise ValueError(
                    f"{what} must satisfy 1 <= A <= B <= --steps {self.steps} (steps A to B "
                    f"are recorded, both included)"
                )
        if self.metrics_file and os.path.isdir(self.metrics_file):
            raise ValueError(f"--metrics-file {self.metrics_file} is a directory: pass a file")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "--tensorboard needs the tensorboard package, which is not installed: "
                "pip install fastpar[tensorboard]"
            )

    def _check_schedule(self) -> None:
        """--schedule, --virtual-stages, --microbatch-group-size and the evaluation flags."""
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        v, sched = self.virtual_stages, SCHEDULES[self.schedule]  # what the schedule takes
        wanted = {
            "selective_recompute": bool(self.recompute) and self.recompute is not True,
            "zero3": self.zero == 3,
            "hf_config": bool(self.hf_config),
            "fused_ce": self.fused_ce and self.pp > 1,
        }
        for feature in [f for f, on in wanted.items() if on and not sched.accepts(f)]:
            raise ValueError(schedule_refusal(self, feature, sched))
        if not sched.chunked:
            if v != 1:
                raise ValueError(
                    f"--virtual-stages {v} needs --schedule {chunked_names()} (got {self.schedule})"
                )
            if self.microbatch_group_size is not None:
                raise ValueError(
                    f"--microbatch-group-size {self.microbatch_group_size} orders the model "
                    f"chunks of --schedule {chunked_names()} (got {self.schedule}); drop it"
                )
        else:
            if self.pp < 2:
                raise ValueError(
                    f"--schedule {self.schedule} needs --pp 2 or more (model chunks go round "
                    "the pipeline ranks); use --schedule 1f1b at --pp 1"
                )
            g = self.microbatch_group_size
            if g is None and self.microbatches % self.pp:
                raise ValueError(
                    f"--schedule {self.schedule} needs --microbatches ({self.microbatches}) to be "
                    f"a multiple of --pp {self.pp} (micro-batches run in groups of pp); use "
                    f"--microbatches {self.microbatches + (-self.microbatches) % self.pp}, or a "
                    "--microbatch-group-size whose last group holds at least pp micro-batches"
                )
            if g is not None:
                try:
                    make_schedule(self.schedule, self.microbatches, v, g).check(self.pp)
                except ValueError as exc:
                    raise ValueError(
                        f"--microbatch-group-size {g} with --microbatches {self.microbatches} "
                        f"and --pp {self.pp}: {exc}"
                    ) from None
            blocks = self.layers + 2  # embedding, layers, head
            if blocks < self.pp * v:
                raise ValueError(
                    f"--pp {self.pp} x --virtual-stages {v} needs {self.pp * v} model chunks of "
                    f"at least one block, but the model has {blocks} blocks (embedding, "
                    f"{self.layers} layers, head): use --virtual-stages <= {blocks // self.pp} "
                    f"or --layers >= {self.pp * v - 2}"
                )

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

    def _check_context(self) -> None:
        check_context_parallel(self)
        if self.fused_ce and self.zero == 3:
            raise ValueError(
                "--fused-ce with --zero 3: the loss reads the head's weight after the head's "
                "forward, when ZeRO-3 has re-sharded it; use --zero 0-2 or drop --fused-ce"
            )

    def check(self) -> None:
        """Refuse an impossible run before any process group exists: one ValueError line naming
        the value and the fix (the data are checked by ``load_data``; the world size under
        torchrun by ``check_world_size``). Resolves --data-dtype left out for a .bin file
        (``fastpar.data.bin_dtype``)."""
        check_ranges(self)
        self._check_outputs()
        if self.plan and not self.hf_config:
            raise ValueError(
                f"--plan {self.plan} is a tensor-parallel plan for an --hf-config model: add "
                "--hf-config FILE, or drop --plan (fastpar's models have their own)"
            )
        self._check_model_flags()
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        self._check_schedule()
        RecomputePolicy.parse(self.recompute)  # a bad --recompute: ValueError naming it
        check_layout(self)  # the mesh's own refusals (hybrid sharding among them)
        check_optimizer(self)
        self._check_context()
        check_packing(self)
        per_rank = self.batch_size // self.dp
        if self.batch_size % self.dp or per_rank % self.microbatches:
            raise ValueError(
                f"batch_size {self.batch_size} must split into dp={self.dp} replicas of "
                f"{self.microbatches} micro-batches each (a multiple of {self.dp * self.microbatches})"
            )
        if self.compile and self.mtp_depth:
            raise ValueError(
                f"--compile with --mtp-depth {self.mtp_depth}: the MTP head is not proven under "
                "torch.compile yet; drop --compile or --mtp-depth"
            )
        if not self.hf_config:
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
