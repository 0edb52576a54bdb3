"""The training run's settings (``TrainConfig``), their checks before any rank starts, and the
command line that fills them."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from dataclasses import dataclass, field, fields

from fastpar.data import (
    BIN_DTYPES,
    bin_dtype,
    index_file,
    tokenizer_eos_id,
    tokenizer_vocab_size,
)
from fastpar.mesh import MeshLayout
from fastpar.models import GPTConfig, LlamaConfig
from fastpar.models.llama import ROUTING_DEFAULTS
from fastpar.parallel.pipeline.recompute import RecomputePolicy
from fastpar.parallel.pipeline.schedules import SCHEDULES, make_schedule
from fastpar.train.checks import (
    TIMEOUT_ENV,
    check_ranges,
    flag,
    infer_dp,
    torchrun_world_size,
)
from fastpar.train.memory import check_memory

DESCRIPTION = (
    "Train a GPT, a Llama or a Hugging Face model with DP x TP x PP x EP, ZeRO and mixed precision."
)


def _seconds(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        return float("nan")  # refused by TrainConfig.check, which names the variable


#: every collective fails after this long instead of hanging (a dead or stuck peer), unless
#: FASTPAR_COLLECTIVE_TIMEOUT or --collective-timeout says otherwise
COLLECTIVE_TIMEOUT_S = 300.0


def default_collective_timeout() -> float:
    """--collective-timeout's default: FASTPAR_COLLECTIVE_TIMEOUT seconds, read when a
    TrainConfig (or the parser) is made, not at import; else ``COLLECTIVE_TIMEOUT_S``."""
    raw = os.environ.get(TIMEOUT_ENV)
    return COLLECTIVE_TIMEOUT_S if raw is None else _seconds(raw)


@dataclass
class TrainConfig:
    """Everything a run needs (the CLI's flags)."""

    model_type: str = "gpt"
    tp: int = 2
    pp: int = 2
    dp: int = 2
    ep: int = 2
    cp: int = 1
    cp_attention: str = "ring"
    zero: int = 1
    fused_ce: bool = False
    precision: str = "fp32"
    microbatches: int = 2
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatch_group_size: int | None = None
    recompute: bool | str = False
    steps: int = 30
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float | None = None
    warmup: int = 5
    lr_schedule: str = "cosine"
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    loss_scale: float = 4096.0
    seed: int = 1234
    vocab_size: int | None = None
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    ffn: int | None = None
    moe_ffn: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    qk_norm: bool = False
    attention_bias: bool = False
    moe_every: int = 2
    experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None
    overlap_chunks: int = 1
    router_score: str = "softmax"
    routed_scaling_factor: float | None = None
    router_groups: int | None = None
    router_group_topk: int | None = None
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    shared_expert_ffn: int | None = None
    shared_expert_gate: bool = False
    aux_loss: str = "micro_batch"
    aux_loss_coef: float = 1e-2
    loss_normalization: str = "token"
    pack: str | None = None
    eos_id: int | None = None
    reset_positions: bool = True
    z_loss_coef: float = 0.0
    sequence_parallel: bool = False
    moe_expert_tp: bool = False
    untied: bool = False
    norm: str = "rmsnorm"
    plan: str | None = None
    data: str | None = None
    data_dtype: str | None = None
    tokenizer: str | None = None
    hf_config: str | None = None
    init_from_hf: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    keep_last: int = 0
    resume: bool = False
    allow_fresh: bool = False
    allow_other_run: bool = False
    allow_schedule_change: bool = False
    collective_timeout: float = field(default_factory=default_collective_timeout)
    max_skipped_steps: int = 20
    debug_checks: bool = False
    profile: str | None = None
    profile_steps: str | None = None
    log_every: int = 1
    quiet: bool = False
    metrics_file: str | None = None
    tensorboard: str | None = None
    peak_tflops: float | None = None
    compile: bool = False
    eval_every: int = 0
    eval_batches: int = 4
    eval_split: float = 0.1

    def __post_init__(self) -> None:
        # --recompute's policy: False (none), True (full: the engine's), or a selective one
        # ("attention", "mlp", "every:K"); the words "none" and "full" become the bools
        if isinstance(self.recompute, str) and self.recompute.strip().lower() in ("none", "full"):
            self.recompute = self.recompute.strip().lower() == "full"
        if self.init_from_hf and not self.hf_config:  # the model is the directory's
            self.hf_config = os.path.join(self.init_from_hf, "config.json")

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

    def model(self) -> GPTConfig | LlamaConfig:
        shared = dict(
            vocab_size=self.vocab, seq_len=self.seq_len, hidden=self.hidden, heads=self.heads,
            layers=self.layers, ffn=self.ffn, moe_every=self.moe_every, num_experts=self.experts,
            top_k=self.top_k, capacity_factor=self.capacity_factor,
            overlap_chunks=self.overlap_chunks, tie_embeddings=not self.untied,
            sequence_parallel=self.sequence_parallel, moe_expert_tp=self.moe_expert_tp,
            cp_attention=self.cp_attention,
            **{name: getattr(self, name) for name in ROUTING_DEFAULTS},
        )  # fmt: skip
        if self.model_type == "llama":
            return LlamaConfig(
                kv_heads=self.kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
                moe_ffn=self.moe_ffn,
                qk_norm=self.qk_norm, attention_bias=self.attention_bias, **shared,
            )  # fmt: skip
        return GPTConfig(norm=self.norm, **shared)

    def _check_model_flags(self) -> None:
        if self.model_type not in ("gpt", "llama"):
            raise ValueError(f"model must be gpt or llama, got {self.model_type!r}")
        defaults = TrainConfig()
        if self.init_from_hf:
            _check_init_from_hf(self)
        if self.hf_config:
            self._check_hf(defaults)
        elif self.model_type == "gpt":
            llama_only = (
                "kv_heads",
                "head_dim",
                "rope_theta",
                "qk_norm",
                "attention_bias",
                "moe_ffn",
            )
            for name in llama_only:
                if getattr(self, name) != getattr(defaults, name):
                    raise ValueError(f"{flag(name)} is a Llama option: add --model llama")
        elif self.norm != "rmsnorm":
            raise ValueError(f"--norm {self.norm} is a GPT option: the Llama uses RMSNorm")
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
            self.data_dtype = bin_dtype(self.data_dtype, self.vocab, self.data)

    def _check_hf(self, defaults: TrainConfig) -> None:
        """--hf-config: the model is the config's; fastpar-model flags do not apply."""
        from fastpar.models.hf import decoders, is_masked_lm, load_config

        own = (
            "model_type",
            "kv_heads",
            "head_dim",
            "qk_norm",
            "attention_bias",
            "ffn",
            "moe_ffn",
            "untied",
            *ROUTING_DEFAULTS,
        )
        for name in own:
            if getattr(self, name) != getattr(defaults, name):
                raise ValueError(
                    f"{flag(name)} does not apply with --hf-config (the config sets the model)"
                )
        if self.ep > 1:
            raise ValueError(
                f"--ep {self.ep} with --hf-config: a Hugging Face MoE block stays replicated over "
                "TP and is not expert-parallel here; use --ep 1"
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
        it, the family must have a built-in plan."""
        from fastpar.models.hf import PLAN_HINT, check_plan, has_builtin_plan, read_plan

        if self.plan:
            check_plan(config, read_plan(self.plan), self.plan)
        elif not has_builtin_plan(config):
            from fastpar.nn.plans import supported

            raise ValueError(
                f"--hf-config {self.hf_config}: model_type {config.model_type!r} has no built-in "
                f"tensor-parallel plan (built-in: {supported()}); {PLAN_HINT}"
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
        """--profile-steps, --peak-tflops, --metrics-file and --tensorboard."""
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
        peak = self.peak_tflops
        if peak is not None and not (math.isfinite(peak) and peak > 0):
            raise ValueError(f"--peak-tflops {peak:g} must be a positive finite number (TFLOP/s)")
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
        v = self.virtual_stages
        if self.schedule == "zb-h1":
            if self.recompute and self.recompute is not True:
                raise ValueError(
                    f"--schedule zb-h1 with a selective --recompute ({self.recompute}): the "
                    "weight-gradient pass would unpack the checkpointed blocks' activations a "
                    "second time and recompute them again (their collectives too); use "
                    "--recompute full (the stage recomputed once, before B) or none"
                )
            if self.zero == 3:
                raise ValueError(
                    "--schedule zb-h1 with --zero 3 is not supported (ZeRO-3's gathers follow "
                    "one backward per forward); use --zero 0, 1 or 2, or --schedule 1f1b"
                )
            if self.hf_config:
                raise ValueError(
                    "--schedule zb-h1 with --hf-config is not supported yet; use --schedule 1f1b"
                )
        if self.schedule != "interleaved":
            if v != 1:
                raise ValueError(
                    f"--virtual-stages {v} needs --schedule interleaved (got {self.schedule})"
                )
            if self.microbatch_group_size is not None:
                raise ValueError(
                    f"--microbatch-group-size {self.microbatch_group_size} orders the model "
                    f"chunks of --schedule interleaved (got {self.schedule}); drop it"
                )
        else:
            if self.pp < 2:
                raise ValueError(
                    "--schedule interleaved needs --pp 2 or more (model chunks go round the "
                    "pipeline ranks); use --schedule 1f1b at --pp 1"
                )
            g = self.microbatch_group_size
            if g is None and self.microbatches % self.pp:
                raise ValueError(
                    f"--schedule interleaved needs --microbatches ({self.microbatches}) to be a "
                    f"multiple of --pp {self.pp} (micro-batches run in groups of pp); use "
                    f"--microbatches {self.microbatches + (-self.microbatches) % self.pp}, or a "
                    "--microbatch-group-size whose last group holds at least pp micro-batches"
                )
            if g is not None:
                try:
                    make_schedule("interleaved", self.microbatches, v, g).check(self.pp)
                except ValueError as exc:
                    raise ValueError(
                        f"--microbatch-group-size {g} with --microbatches {self.microbatches} "
                        f"and --pp {self.pp}: {exc}"
                    ) from None
            if self.zero == 3:
                raise ValueError(
                    "--schedule interleaved with --zero 3 is not supported (ZeRO-3 gathers "
                    "around the whole stage's forward, model chunks run one by one); use --zero "
                    "0, 1 or 2"
                )
            if self.hf_config:
                raise ValueError(
                    "--schedule interleaved with --hf-config is not supported yet; use "
                    "--schedule 1f1b or gpipe"
                )
            blocks = self.layers + 2  # embedding, layers, head
            if blocks < self.pp * v:
                raise ValueError(
                    f"--pp {self.pp} x --virtual-stages {v} needs {self.pp * v} model chunks of "
                    f"at least one block, but the model has {blocks} blocks (embedding, "
                    f"{self.layers} layers, head): use --virtual-stages <= {blocks // self.pp} "
                    f"or --layers >= {self.pp * v - 2}"
                )
        if not 0.0 < self.eval_split < 1.0:
            raise ValueError(
                f"--eval-split {self.eval_split:g} must be a fraction strictly between 0 and 1 "
                "(e.g. 0.1: the last 10% of the token ids are held out)"
            )

    def _check_packing(self) -> None:
        _check_packing(self)

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
        _cp_checks(self)
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
        if self.allow_schedule_change and not self.checkpoint_dir:
            raise ValueError(
                "--allow-schedule-change needs --checkpoint-dir DIR (where the run's checkpoints "
                "are written and read): add it, or drop --allow-schedule-change"
            )
        self._check_outputs()
        if self.plan and not self.hf_config:
            raise ValueError(
                f"--plan {self.plan} is a tensor-parallel plan for an --hf-config model: add "
                "--hf-config FILE, or drop --plan (fastpar's models have their own)"
            )
        self._check_model_flags()
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        self._check_schedule()
        RecomputePolicy.parse(self.recompute)  # a bad --recompute: ValueError naming it
        MeshLayout(self.world_size, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp)
        self._check_context()
        self._check_packing()
        per_rank = self.batch_size // self.dp
        if self.batch_size % self.dp or per_rank % self.microbatches:
            raise ValueError(
                f"batch_size {self.batch_size} must split into dp={self.dp} replicas of "
                f"{self.microbatches} micro-batches each (a multiple of {self.dp * self.microbatches})"
            )
        if not self.hf_config:
            self.model().check(self.tp, self.pp, self.ep)
            check_memory(self)  # activations that clearly do not fit this machine


def _check_init_from_hf(cfg: TrainConfig) -> None:
    """--init-from-hf DIR: a save_pretrained directory whose config.json is --hf-config's."""
    from fastpar.models.hf import read_config_json

    what, implied = (
        f"--init-from-hf {cfg.init_from_hf}",
        os.path.join(cfg.init_from_hf, "config.json"),
    )
    if not os.path.isfile(implied):
        raise ValueError(
            f"{what} holds no config.json: pass a directory written by save_pretrained "
            "(config.json + model.safetensors or its index)"
        )
    if not any(n.endswith(".safetensors") for n in os.listdir(cfg.init_from_hf)):
        raise ValueError(
            f"{what} holds no *.safetensors weights: save the model with "
            "save_pretrained(DIR) (safe_serialization, the default) and pass that DIR"
        )
    if os.path.abspath(cfg.hf_config) != os.path.abspath(implied):
        skip = ("transformers_version", "_name_or_path")
        ours, theirs = (
            {k: v for k, v in read_config_json(p).items() if k not in skip}
            for p in (cfg.hf_config, implied)
        )
        keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if keys:
            raise ValueError(
                f"--hf-config {cfg.hf_config} differs from {implied} ({', '.join(keys[:4])}): "
                f"{what} trains the model of its own config.json; drop --hf-config"
            )


def _check_packing(cfg: TrainConfig) -> None:
    """--pack / --eos-id / --loss-normalization: what packed documents can run exactly."""
    if cfg.loss_normalization not in ("token", "sequence"):
        raise ValueError(
            f"--loss-normalization must be token or sequence, got {cfg.loss_normalization!r}"
        )
    if cfg.pack not in (None, "stream", "documents"):
        raise ValueError(f"--pack must be stream or documents, got {cfg.pack!r}")
    if cfg.eos_id is not None and not 0 <= cfg.eos_id < cfg.vocab:
        raise ValueError(
            f"--eos-id {cfg.eos_id} is not a token id of the {cfg.vocab}-token vocabulary"
        )
    if cfg.pack == "documents" and cfg.document_source is None:
        raise ValueError(
            "--pack documents needs document boundaries: pass --eos-id ID (the token that ends "
            "each document in --data), a --tokenizer with an end-of-document token, a .bin "
            "with its .idx of document offsets, or a .jsonl; or use --pack stream"
        )
    if cfg.pack == "stream" and (cfg.data or "").endswith(".jsonl"):
        raise ValueError(
            f"--pack stream with {cfg.data}: a .jsonl holds documents with prompt tokens the "
            "loss must ignore, which a stream would train on; drop --pack stream"
        )
    if cfg.packs_documents and cfg.hf_config:
        from fastpar.models.hf import check_documents, load_config

        try:
            check_documents(load_config(cfg.hf_config))
        except ValueError as exc:
            raise ValueError(f"--pack documents with --hf-config {cfg.hf_config}: {exc}") from exc
    if cfg.schedule == "zb-h1" and cfg.sequence_parallel and cfg.tp > 1:
        raise ValueError(
            "--schedule zb-h1 with --sequence-parallel at --tp > 1 gives gradients that differ "
            "from the single-process model's (fastpar.verify DISAGREES on some runs: the split "
            "backward and the sequence-parallel collectives); use --schedule 1f1b, or drop "
            "--sequence-parallel"
        )


def _cp_checks(cfg: TrainConfig) -> None:
    """Context parallelism: the sequence splits into 2·cp equal chunks, each rank's pair of
    chunks again over TP under sequence parallelism."""
    if cfg.cp_attention not in ("ring", "all-to-all"):
        raise ValueError(f"--cp-attention must be ring or all-to-all, got {cfg.cp_attention!r}")
    if cfg.cp == 1:
        return
    if cfg.cp_attention == "all-to-all" and (cfg.heads // cfg.tp) % cfg.cp:
        raise ValueError(
            f"--cp-attention all-to-all scatters this rank's {cfg.heads // cfg.tp} query heads "
            f"(--heads {cfg.heads} / --tp {cfg.tp}) over --cp {cfg.cp}: they must divide by it; "
            "use --cp-attention ring"
        )
    if cfg.seq_len % (2 * cfg.cp):
        raise ValueError(
            f"--cp {cfg.cp} splits each sequence into 2*cp = {2 * cfg.cp} equal chunks: "
            f"--seq-len {cfg.seq_len} is not divisible by {2 * cfg.cp}"
        )
    if cfg.moe_every and cfg.capacity_factor is not None:
        raise ValueError(
            f"--cp {cfg.cp} with --capacity-factor {cfg.capacity_factor}: each rank routes its "
            "chunks of the sequence, so a capacity would drop per chunk (other tokens than the "
            "single-process model); leave --capacity-factor out (dropless)"
        )
    local = cfg.seq_len // cfg.cp
    if cfg.sequence_parallel and cfg.tp > 1 and local % cfg.tp:
        raise ValueError(
            f"--sequence-parallel with --cp {cfg.cp}: this rank's {local} tokens do not split "
            f"over tp {cfg.tp}; use a --seq-len that is a multiple of {cfg.cp * cfg.tp * 2}"
        )


def config_from(args: argparse.Namespace, world: int | None = None) -> TrainConfig:
    """The TrainConfig of parsed flags. ``world``: the job's world size (default: torchrun's
    WORLD_SIZE, None when self-started); --dp left out is ``world / (tp * pp)`` under torchrun,
    else 2. Never raises: ``TrainConfig.check`` and ``check_world_size`` judge the result."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if values["ep"] is None:  # the default: expert parallelism for fastpar's MoE models only
        values["ep"] = 1 if values["hf_config"] or values["init_from_hf"] else TrainConfig.ep
    if values["dp"] is None:
        world = torchrun_world_size() if world is None else world
        tp_cp = values["tp"] * (values.get("cp") or 1)  # dp = world / (tp * cp * pp)
        values["dp"] = infer_dp(tp_cp, values["pp"], world, TrainConfig.dp)
    return TrainConfig(**values)
