"""The trainer's flags of ``python -m fastpar.train``, each declared once, as a field of
``TrainOptions`` (``fastpar.cliutil.option``; the model-choosing ones of its base ``ModelOptions``);
the model's flags are its config's fields (``fastpar.models.native.model_flags``). The parser
derives from both (``fastpar.train.config.flag_specs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastpar.cliutil import option
from fastpar.data import BIN_DTYPES
from fastpar.models import native
from fastpar.models.shape import LAYOUT, MODEL
from fastpar.moe.config import ROUTING
from fastpar.nn import styles
from fastpar.nn.fp8_config import Fp8Config
from fastpar.optim.config import OptimizerConfig
from fastpar.parallel.pipeline.schedules import SCHEDULES
from fastpar.train.checks import (
    COLLECTIVE_TIMEOUT_S,
    LR_SCHEDULES,
    SEED_LIMIT,
    TIMEOUT_ENV,
    TIMEOUT_LIMIT,
    default_collective_timeout,
)

TRAINING, DATA = "training", "data"
CHECKPOINTS, EVALUATION, OUTPUT, FAILURES = "checkpoints", "evaluation", "output", "failures"
GROUPS = (LAYOUT, MODEL, ROUTING, TRAINING, DATA, CHECKPOINTS, EVALUATION, OUTPUT, FAILURES)
"""The sections of --help, in order: every field's ``Option.group`` is one of them."""


@dataclass
class ModelOptions:
    """The flags that choose the model (``option(resume=...)``: what resuming a checkpoint with
    another value does)."""

    model_type: str = option(
        "gpt",
        MODEL,
        words=native.REGISTRY,
        help="the model: fastpar's GPT, its Llama (GQA, RoPE, SwiGLU, RMSNorm), or its "
        "DeepSeek-V3 class (multi-head latent attention, DeepSeekMoE after --first-k-dense "
        "dense blocks)",
        resume="refuse",
    )
    hf_config: str | None = option(
        None,
        MODEL,
        metavar="FILE",
        help="a Hugging Face config.json: train that model (random init) with its family's "
        "built-in plan instead of the GPT / Llama",
    )
    vocab_size: int | None = option(
        None, MODEL, help="vocabulary size (default: the tokenizer's, else 256 bytes)"
    )
    init_from_hf: str | None = option(
        None,
        MODEL,
        metavar="DIR",
        help="a local Hugging Face directory (config.json + *.safetensors, as save_pretrained "
        "writes it): train that model from its weights (implies --hf-config DIR/config.json; "
        "each rank reads its slices; fresh optimizer, step 0; --resume's checkpoint wins)",
    )
    plan: str | None = option(
        None,
        MODEL,
        metavar="FILE",
        help=lambda: (
            "with --hf-config: the tensor-parallel plan, a TOML or JSON table of "
            f"module-name pattern -> style ({styles.listing()}; or [style, {{options}}]) as "
            "fastpar.parallelize takes it, for a family without a built-in plan (or to replace "
            "it); the LM head's logits stay split over the vocabulary"
        ),
    )


@dataclass
class TrainOptions(ModelOptions):
    """The trainer's flags: one field each, listed by --help section (``GROUPS``); the
    optimizer's are ``OptimizerConfig``'s fields, held as ``optimizer``."""

    tp: int = option(
        2, LAYOUT, "tensor-parallel size: ranks that split every layer's matrices", at_least=1
    )
    pp: int = option(
        2, LAYOUT, "pipeline-parallel size: ranks that split the layers into stages", at_least=1
    )
    dp: int = option(
        2,
        LAYOUT,
        deferred=True,
        help="data-parallel size (default: --dp-shard x --dp-replicate when both are given, else "
        "2, under torchrun WORLD_SIZE / (tp*cp*pp)); world size = tp*cp*pp*dp; any two of --dp, "
        "--dp-shard, --dp-replicate give the third",
        at_least=1,
    )
    dp_shard: int | None = option(
        None,
        LAYOUT,
        metavar="S",
        help="hybrid sharding (HSDP): ZeRO shards over S consecutive dp ranks (x cp); dp = S x "
        "--dp-replicate (default: one node's dp ranks under a multi-node torchrun, else all of "
        "dp: full sharding)",
    )
    dp_replicate: int | None = option(
        None,
        LAYOUT,
        metavar="R",
        help="hybrid sharding: R copies of the shards, the reduced shard all-reduced over them "
        "(default dp / --dp-shard)",
    )
    ep: int = option(
        2,
        LAYOUT,
        deferred=True,
        help="expert-parallel size, a divisor of dp: ranks that split each MoE layer's experts "
        "(default 2; 1 with --hf-config)",
        at_least=1,
    )
    cp: int = option(
        1,
        LAYOUT,
        help="context-parallel size: each sequence split over CP ranks (2*cp chunks, ring "
        "attention; --model gpt / llama)",
        at_least=1,
    )
    zero: int = option(
        1,
        LAYOUT,
        words=(0, 1, 2, 3),
        help="ZeRO stage over data parallelism: 0 replicated, 1 optimizer state sharded, 2 and "
        "gradients, 3 and parameters",
    )
    microbatches: int = option(
        2,
        LAYOUT,
        help="NUMBER of micro-batches each replica splits its share of --batch-size into (not a "
        "micro-batch size, as Megatron's --micro-batch-size is)",
        at_least=1,
    )
    schedule: str = option(
        "1f1b",
        LAYOUT,
        words=SCHEDULES,
        help="pipeline schedule (interleaved: Megatron's interleaved 1F1B over --virtual-stages "
        "model chunks per rank; zb-h1: zero-bubble ZB-H1, each backward split into input and "
        "weight gradients, at 1F1B's activation memory)",
    )
    virtual_stages: int = option(
        1,
        LAYOUT,
        help="--schedule interleaved: model chunks per pipeline rank (virtual stages, placed "
        "round-robin; --microbatches a multiple of --pp)",
        at_least=1,
    )
    microbatch_group_size: int | None = option(
        None,
        LAYOUT,
        metavar="G",
        help="--schedule interleaved: micro-batches each model chunk runs before the next chunk's "
        "turn (Megatron's --microbatch-group-size-per-virtual-pipeline-stage; default --pp). "
        "Above --pp it gives the ring slack that hides message latency, for (V - 1)(G - pp) "
        "more chunk activations in flight",
        at_least=1,
        note="or left out: its default",
    )
    recompute: bool | str = option(
        False,
        LAYOUT,
        help="recompute activations in backward instead of keeping them: full (--recompute alone: "
        "each micro-batch's whole stage, the pipeline engine's), attention or mlp (that "
        "sub-module of every block), every:K (every K-th block whole), none (--no-recompute)",
    )
    steps: int = option(
        30, TRAINING, "optimizer steps to train (Megatron: --train-iters)", at_least=1
    )
    batch_size: int = option(
        16,
        TRAINING,
        help="GLOBAL batch in sequences, over every replica and micro-batch (Megatron: "
        "--global-batch-size; torchtitan's batch size is per replica)",
        resume="warn",
        at_least=1,
    )
    fused_ce: bool = option(
        False,
        TRAINING,
        help="the loss as a vocab-parallel fused linear cross-entropy: the head's logits exist "
        "only a chunk of tokens at a time (fastpar.ops.linear_cross_entropy)",
    )
    precision: str = option(
        "fp32",
        TRAINING,
        words=("fp32", "bf16", "fp16", "fp8"),
        help="parameters and activations (fp32 master weights for bf16 / fp16 / fp8; fp16 adds a "
        "dynamic loss scaler; fp8: bf16 with the linear layers' GEMMs in fp8, --fp8-recipe)",
        resume="warn",
    )
    lr: float = option(3e-3, TRAINING, "peak learning rate (AdamW)", positive=True)
    min_lr: float | None = option(
        None,
        TRAINING,
        help="where the cosine schedule ends (default: --lr / 10; Megatron's is 0)",
        at_least=0,
    )
    warmup: int = option(
        5, TRAINING, "linear warm-up steps from 0 to --lr", at_least=0, note="0: no warm-up"
    )
    lr_schedule: str = option(
        "cosine",
        TRAINING,
        words=LR_SCHEDULES,
        help="after the warm-up: " + "; ".join(f"{k}: {v}" for k, v in LR_SCHEDULES.items()),
    )
    weight_decay: float = option(
        0.1, TRAINING, "AdamW weight decay, on matrices only", resume="warn", at_least=0
    )
    max_grad_norm: float = option(
        1.0, TRAINING, "clip the global gradient norm to this", resume="warn", positive=True
    )
    loss_scale: float = option(
        4096.0,
        TRAINING,
        help="fp16: the loss scaler's first scale (Megatron's is 2^32)",
        resume="warn",
        at_least=1.0,  # the scaler's floor; 2^40 = 65504 / 2^-24: fp16's largest value over
        at_most=2.0**40,  # its smallest, a scale at which every non-zero gradient overflows
        message="{flag} {value} must be in [1, 2^40 = 1.1e+12] (the fp16 loss scaler's floor, "
        "and the scale past which every non-zero fp16 gradient overflows), e.g. 4096",
    )
    seed: int = option(
        1234,
        TRAINING,
        help="weights and data: the same seed gives the same run on any layout",
        resume="warn",
        at_least=-SEED_LIMIT,
        at_most=SEED_LIMIT,
        message=f"{{flag}} {{value}} is out of range: use a seed in ±{SEED_LIMIT}",
    )
    compile: bool = option(
        False,
        TRAINING,
        help="torch.compile each transformer block (the inductor backend; CPUs included)",
    )
    loss_normalization: str = option(
        "token",
        TRAINING,
        words=("token", "sequence"),
        help="token: the step's loss is the sum over every valid target of the global batch over "
        "their count (one device's mean, however ignored targets fall); sequence: each "
        "micro-batch's mean, averaged (a mean of means)",
    )
    data: str | None = option(
        None,
        DATA,
        metavar="FILE",
        help="a text file, a .npy or a .bin file of token ids (default: an embedded corpus)",
        resume="warn",
    )
    data_dtype: str | None = option(
        None,
        DATA,
        words=tuple(sorted(BIN_DTYPES)),
        help="ids of a .bin file (default uint16; a vocabulary of more than 65536 tokens needs "
        "uint32, given explicitly)",
        resume="warn",
    )
    tokenizer: str | None = option(
        None,
        DATA,
        metavar="FILE",
        help="a tokenizer.json (Hugging Face tokenizers) for text data; sets the vocabulary",
        resume="warn",
    )
    pack: str | None = option(
        None,
        DATA,
        words=("stream", "documents"),
        help="stream: windows of one token stream, attention across the whole window (the default "
        "without --eos-id); documents (the default with --eos-id): each --eos-id ends a "
        "document, attention stops at document boundaries, a document's last token predicts "
        "nothing",
    )
    eos_id: int | None = option(
        None,
        DATA,
        metavar="ID",
        help="the end-of-document token id that splits --data into documents",
    )
    reset_positions: bool = option(
        True, DATA, help="with --pack documents: positions restart at 0 at each document start"
    )
    checkpoint_dir: str | None = option(
        None,
        CHECKPOINTS,
        metavar="DIR",
        help="where checkpoints (step_N directories, each with its train_config.json) are written "
        "and resumed from; the last step is always saved",
    )
    save_every: int = option(
        0,
        CHECKPOINTS,
        "also save every N steps (0: only the last step)",
        at_least=0,
        note="0: only the last step",
    )
    keep_last: int = option(
        0,
        CHECKPOINTS,
        "keep only the newest N checkpoints (0: keep all)",
        at_least=0,
        note="0: keep every checkpoint",
    )
    resume: bool = option(
        False, CHECKPOINTS, help="continue from the newest usable checkpoint in --checkpoint-dir"
    )
    allow_fresh: bool = option(
        False,
        CHECKPOINTS,
        help="with --resume: start from step 0 when --checkpoint-dir holds no usable checkpoint "
        "(default: an error)",
    )
    allow_other_run: bool = option(
        False,
        CHECKPOINTS,
        help="write into a --checkpoint-dir that holds another run's checkpoints",
    )
    allow_schedule_change: bool = option(
        False,
        CHECKPOINTS,
        help="with --resume: train on when --steps, --lr-schedule, --warmup, --lr or --min-lr "
        "differ from the checkpoint's and change the learning rate of the steps left "
        "(default: an error naming both rates)",
    )
    eval_every: int = option(
        0,
        EVALUATION,
        help="every N steps (and the last), the validation loss of --eval-batches held-out "
        "batches, pipelined forward-only, as val_loss in the log line and metrics (0: never); "
        "under --loss-normalization token every valid held-out target counts once",
        at_least=0,
        note="0: no evaluation",
    )
    eval_batches: int = option(
        4, EVALUATION, "batches of --batch-size sequences per evaluation", at_least=1
    )
    eval_split: float = option(
        0.1,
        EVALUATION,
        help="with --eval-every: the fraction of the token ids held out at the END of the data for "
        "validation; training then reads only the ids before it",
        positive=True,
        at_most=math.nextafter(1.0, 0.0),  # below 1
        message="{flag} {value} must be a fraction strictly between 0 and 1 (e.g. 0.1: the last "
        "10% of the token ids are held out)",
    )
    log_every: int = option(
        1,
        OUTPUT,
        help="print and record a line every N steps, and the last (steps in between make no host "
        "sync)",
        at_least=1,
        note="1: every step",
    )
    quiet: bool = option(
        False,
        OUTPUT,
        help="print nothing but errors and warnings (the profiler's own lines included)",
    )
    metrics_file: str | None = option(
        None,
        OUTPUT,
        metavar="FILE",
        help="append one JSON object per logged step to this file (step, loss, lr, grad_norm, "
        "tokens/s, MFU, memory, skipped, elapsed; a run from step 0 starts it afresh)",
    )
    tensorboard: str | None = option(
        None,
        OUTPUT,
        metavar="DIR",
        help="write the logged steps' numbers as TensorBoard scalars to DIR (needs pip install "
        "fastpar[tensorboard])",
    )
    peak_tflops: float | None = option(
        None,
        OUTPUT,
        metavar="TFLOPS",
        help="one device's peak TFLOP/s for MFU (default: known GPUs' dense bf16 peak; none on "
        "CPUs, so no MFU there)",
        positive=True,
        note="TFLOP/s",
    )
    profile: str | None = option(
        None,
        OUTPUT,
        metavar="DIR",
        help="write a torch.profiler Chrome/Perfetto trace per rank to DIR/trace_rank<R>.json",
    )
    profile_steps: str | None = option(
        None,
        OUTPUT,
        metavar="A:B",
        help="with --profile: record only steps A to B, both included (e.g. 3:5; default: every "
        "step); the trace marks each as ProfilerStep#N",
    )
    collective_timeout: float = option(
        group=FAILURES,
        metavar="SECONDS",
        default_factory=default_collective_timeout,
        help="seconds any collective of any process group may wait before the job fails "
        f"(a stuck or dead rank; default {TIMEOUT_ENV}, else {COLLECTIVE_TIMEOUT_S:g})",
        positive=True,
        at_most=TIMEOUT_LIMIT,
        unit="seconds",
        note="pass a timeout a stuck rank is worth waiting for, e.g. 300",
    )
    on_save_error: str = option(
        "stop",
        FAILURES,
        "a failed save (a full disk): stop, or train on",
        words=("stop", "continue"),
    )
    max_skipped_steps: int = option(
        20,
        FAILURES,
        help="end the run after this many consecutive steps skipped for inf/NaN gradients (the "
        "fp16 loss scaler's, or a non-finite gradient norm); the back-off from a --loss-scale "
        "above 4096 down to 4096 is not counted",
        at_least=1,
    )
    debug_checks: bool = option(
        False,
        FAILURES,
        help="cross-rank input checks that cost a collective per call (shapes into TP layers, "
        "cross-entropy targets); also FASTPAR_DEBUG_CHECKS=1",
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer and its state's dtype (``--optimizer``, ``--muon-momentum``,
    ``--muon-per-head``, ``--optimizer-state-dtype``: ``OptimizerConfig``'s flags)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """--precision fp8's recipe and filter (``--fp8-recipe``, ``--fp8-exclude``)."""
