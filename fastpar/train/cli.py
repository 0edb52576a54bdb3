"""``python -m fastpar.train``: the command, its flags (``build_parser``: every flag with its
help and allowed values) and ``--config FILE`` (TOML or JSON; the flags on the command line
override it). Every flag, the data and (under torchrun) the world size are checked before any
rank starts or any process group exists: a bad run ends with one ``error:`` line (one per
machine under torchrun: its local rank 0 says it) and exit code 2."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
import typing
from dataclasses import fields

from fastpar.checkpoint import CheckpointError
from fastpar.cliutil import Parser
from fastpar.data import BIN_DTYPES
from fastpar.launch import RankError
from fastpar.parallel.pipeline.schedules import SCHEDULES
from fastpar.train.batches import load_data
from fastpar.train.checks import (
    LR_SCHEDULES,
    TIMEOUT_ENV,
    check_devices,
    check_world_size,
    flag,
    torchrun_world_size,
)
from fastpar.train.config import COLLECTIVE_TIMEOUT_S, DESCRIPTION, TrainConfig, config_from
from fastpar.train.launch import launch
from fastpar.train.memory import WARN_FRACTION, estimate
from fastpar.train.summary import cpu_cores, default_world_note, done_line, layout_given

#: every flag's help; "(default X)" is added for a flag whose default is not None
_HELP = {
    "virtual_stages": "--schedule interleaved: model chunks per pipeline rank (virtual stages, "
    "placed round-robin; --microbatches a multiple of --pp)",
    "microbatch_group_size": "--schedule interleaved: micro-batches each model chunk runs "
    "before the next chunk's turn (Megatron's --microbatch-group-size-per-virtual-pipeline-"
    "stage; default --pp). Above --pp it gives the ring slack that hides message latency, for "
    "(V - 1)(G - pp) more chunk activations in flight",
    "eval_every": "every N steps (and the last), the validation loss of --eval-batches held-out "
    "batches, pipelined forward-only, as val_loss in the log line and metrics (0: never)",
    "eval_batches": "batches of --batch-size sequences per evaluation",
    "eval_split": "with --eval-every: the fraction of the token ids held out at the END of the "
    "data for validation; training then reads only the ids before it",
    "model_type": "the model: fastpar's GPT, or its Llama (GQA, RoPE, SwiGLU, RMSNorm)",
    "tp": "tensor-parallel size: ranks that split every layer's matrices",
    "pp": "pipeline-parallel size: ranks that split the layers into stages",
    "dp": "data-parallel size (default 2; under torchrun WORLD_SIZE / (tp*pp)); "
    "world size = tp*pp*dp",
    "ep": "expert-parallel size, a divisor of dp: ranks that split each MoE layer's experts "
    "(default 2; 1 with --hf-config)",
    "zero": "ZeRO stage over data parallelism: 0 replicated, 1 optimizer state sharded, 2 and "
    "gradients, 3 and parameters",
    "precision": "parameters and activations (fp32 master weights for bf16 / fp16; fp16 adds "
    "a dynamic loss scaler)",
    "microbatches": "NUMBER of micro-batches each replica splits its share of --batch-size "
    "into (not a micro-batch size, as Megatron's --micro-batch-size is)",
    "schedule": "pipeline schedule (interleaved: Megatron's interleaved 1F1B over "
    "--virtual-stages model chunks per rank; zb-h1: zero-bubble ZB-H1, each backward split into "
    "input and weight gradients, at 1F1B's activation memory)",
    "recompute": "recompute activations in backward instead of keeping them: full (--recompute "
    "alone: each micro-batch's whole stage, the pipeline engine's), attention or mlp (that "
    "sub-module of every block), every:K (every K-th block whole), none (--no-recompute)",
    "steps": "optimizer steps to train (Megatron: --train-iters)",
    "batch_size": "GLOBAL batch in sequences, over every replica and micro-batch (Megatron: "
    "--global-batch-size; torchtitan's batch size is per replica)",
    "lr": "peak learning rate (AdamW)",
    "min_lr": "where the cosine schedule ends (default: --lr / 10; Megatron's is 0)",
    "warmup": "linear warm-up steps from 0 to --lr",
    "lr_schedule": "after the warm-up: " + "; ".join(f"{k}: {v}" for k, v in LR_SCHEDULES.items()),
    "weight_decay": "AdamW weight decay, on matrices only",
    "max_grad_norm": "clip the global gradient norm to this",
    "loss_scale": "fp16: the loss scaler's first scale (Megatron's is 2^32)",
    "seed": "weights and data: the same seed gives the same run on any layout",
    "vocab_size": "vocabulary size (default: the tokenizer's, else 256 bytes)",
    "seq_len": "tokens per sequence",
    "hidden": "model width",
    "heads": "attention heads",
    "layers": "transformer blocks",
    "ffn": "MLP width (default: gpt 4*hidden, llama 8*hidden/3 rounded up to 64)",
    "moe_ffn": "llama: width of each expert (default: --ffn)",
    "kv_heads": "llama: key/value heads for grouped-query attention (default: --heads)",
    "head_dim": "llama: width of a head (default: hidden / heads)",
    "rope_theta": "llama: RoPE base",
    "qk_norm": "llama: Qwen3-style RMSNorm on every query and key head",
    "attention_bias": "llama: Qwen2-style q/k/v bias",
    "moe_every": "every N-th block's MLP is a mixture of experts (0: no MoE blocks)",
    "experts": "experts per MoE layer",
    "top_k": "experts each token is routed to",
    "capacity_factor": "MoE capacity factor: tokens over capacity are dropped (default: dropless)",
    "overlap_chunks": "MoE: split the all-to-all into K chunks overlapped with expert GEMMs "
    "(1: no overlap)",
    "router_score": "MoE router scores: softmax over the experts, or sigmoid per expert "
    "(DeepSeek-V3)",
    "routed_scaling_factor": "MoE: multiply the routed experts' combine weights by this "
    "(DeepSeek-V3 routed_scaling_factor; default 1)",
    "router_groups": "MoE group-limited routing: split the experts into N equal groups "
    "(DeepSeek-V3 n_group; needs --router-group-topk)",
    "router_group_topk": "MoE group-limited routing: each token routes inside its best K "
    "groups (DeepSeek-V3 topk_group; needs --router-groups)",
    "expert_bias": "MoE aux-loss-free balancing (DeepSeek-V3): a per-expert bias steers the "
    "top-k choice (not the weights); after every optimizer step it moves by "
    "--bias-update-rate against the load counted over data parallelism (a skipped step moves "
    "nothing); saved in checkpoints",
    "bias_update_rate": "--expert-bias: the bias step per optimizer step",
    "shared_expert_ffn": "MoE: width of a shared expert run on every token beside the routed "
    "ones (DeepSeek / Qwen2-MoE; default: none)",
    "shared_expert_gate": "MoE: scale the shared expert by sigmoid(x W_g) (Qwen2-MoE; needs "
    "--shared-expert-ffn)",
    "aux_loss": "MoE load-balancing loss: micro_batch (Switch, over a micro-batch's tokens), "
    "sequence (DeepSeek-V3's per-sequence loss), none (e.g. with --expert-bias)",
    "aux_loss_coef": "MoE: the load-balancing loss's coefficient",
    "pack": "stream: windows of one token stream, attention across the whole window (the "
    "default without --eos-id); documents (the default with --eos-id): each --eos-id ends a "
    "document, attention stops at document boundaries, a document's last token predicts nothing",
    "eos_id": "the end-of-document token id that splits --data into documents",
    "reset_positions": "with --pack documents: positions restart at 0 at each document start",
    "loss_normalization": "token: the step's loss is the sum over every valid target of the "
    "global batch over their count (one device's mean, however ignored targets fall); "
    "sequence: each micro-batch's mean, averaged (a mean of means)",
    "z_loss_coef": "MoE: the router z-loss's coefficient (ST-MoE; 0: off)",
    "sequence_parallel": "split activations between blocks along the sequence over TP (MoE "
    "blocks route each rank's chunk, dropless; with --moe-expert-tp they gather it)",
    "cp": "context-parallel size: each sequence split over CP ranks (2*cp chunks, ring "
    "attention; --model gpt / llama)",
    "fused_ce": "the loss as a vocab-parallel fused linear cross-entropy: the head's logits "
    "exist only a chunk of tokens at a time (fastpar.ops.linear_cross_entropy)",
    "cp_attention": "attention under --cp: ring (K/V passed around the cp ranks) or "
    "all-to-all (heads scattered over cp, Ulysses; heads / tp must divide by cp)",
    "moe_expert_tp": "split each MoE expert's FFN over TP (expert tensor parallelism: w1 by "
    "columns, w2 by rows) instead of every TP rank holding whole experts",
    "untied": "an LM head of its own instead of the embedding's weight",
    "norm": "gpt: the normalisation layers",
    "data": "a text file, a .npy or a .bin file of token ids (default: an embedded corpus)",
    "data_dtype": "ids of a .bin file (default uint16; a vocabulary of more than 65536 tokens "
    "needs uint32, given explicitly)",
    "tokenizer": "a tokenizer.json (Hugging Face tokenizers) for text data; sets the vocabulary",
    "hf_config": "a Hugging Face config.json: train that model (random init) with its "
    "family's built-in plan instead of the GPT / Llama",
    "init_from_hf": "a local Hugging Face directory (config.json + *.safetensors, as "
    "save_pretrained writes it): train that model from its weights (implies --hf-config "
    "DIR/config.json; each rank reads its slices; fresh optimizer, step 0; --resume's "
    "checkpoint wins)",
    "plan": "with --hf-config: the tensor-parallel plan, a TOML or JSON table of module-name "
    "pattern -> style (column, row, vocab, per_head, replicate, experts; or [style, {options}]) "
    "as fastpar.parallelize takes it, for a family without a built-in plan (or to replace it); "
    "the LM head's logits stay split over the vocabulary",
    "checkpoint_dir": "where checkpoints (step_N directories, each with its train_config.json) "
    "are written and resumed from; the last step is always saved",
    "save_every": "also save every N steps (0: only the last step)",
    "keep_last": "keep only the newest N checkpoints (0: keep all)",
    "resume": "continue from the newest usable checkpoint in --checkpoint-dir",
    "allow_fresh": "with --resume: start from step 0 when --checkpoint-dir holds no usable "
    "checkpoint (default: an error)",
    "allow_other_run": "write into a --checkpoint-dir that holds another run's checkpoints",
    "allow_schedule_change": "with --resume: train on when --steps, --lr-schedule, --warmup, "
    "--lr or --min-lr differ from the checkpoint's and change the learning rate of the steps "
    "left (default: an error naming both rates)",
    "collective_timeout": "seconds any collective of any process group may wait before the "
    f"job fails (a stuck or dead rank; default {TIMEOUT_ENV}, else {COLLECTIVE_TIMEOUT_S:g})",
    "max_skipped_steps": "end the run after this many consecutive steps skipped for inf/NaN "
    "gradients (the fp16 loss scaler's, or a non-finite gradient norm)",
    "debug_checks": "cross-rank input checks that cost a collective per call (shapes into TP "
    "layers, cross-entropy targets); also FASTPAR_DEBUG_CHECKS=1",
    "profile": "write a torch.profiler Chrome/Perfetto trace per rank to DIR/trace_rank<R>.json",
    "profile_steps": "with --profile: record only steps A to B, both included (e.g. 3:5; "
    "default: every step); the trace marks each as ProfilerStep#N",
    "log_every": "print and record a line every N steps, and the last (steps in between make "
    "no host sync)",
    "quiet": "print nothing but errors and warnings (the profiler's own lines included)",
    "metrics_file": "append one JSON object per logged step to this file (step, loss, lr, "
    "grad_norm, tokens/s, MFU, memory, skipped, elapsed; a run from step 0 starts it afresh)",
    "tensorboard": "write the logged steps' numbers as TensorBoard scalars to DIR (needs "
    "pip install fastpar[tensorboard])",
    "peak_tflops": "one device's peak TFLOP/s for MFU (default: known GPUs' dense bf16 peak; "
    "none on CPUs, so no MFU there)",
    "compile": "torch.compile each transformer block (the inductor backend; CPUs included)",
}
#: the words a flag takes, shown as its metavar (checked by TrainConfig.check, whose error
#: names the fix)
_WORDS = {
    "model_type": ("gpt", "llama"),
    "precision": ("fp32", "bf16", "fp16"),
    "zero": (0, 1, 2, 3),
    "schedule": tuple(SCHEDULES),
    "cp_attention": ("ring", "all-to-all"),
    "lr_schedule": tuple(LR_SCHEDULES),
    "norm": ("rmsnorm", "layernorm"),
    "data_dtype": tuple(sorted(BIN_DTYPES)),
    "router_score": ("softmax", "sigmoid"),
    "aux_loss": ("micro_batch", "sequence", "none"),
    "loss_normalization": ("token", "sequence"),
    "pack": ("stream", "documents"),
}
#: flags whose default is None (or follows another flag): their types
_OPTIONAL = {"vocab_size": int, "ffn": int, "moe_ffn": int, "min_lr": float, "kv_heads": int,
             "head_dim": int, "capacity_factor": float, "data": str, "tokenizer": str,
             "ep": int, "dp": int, "hf_config": str, "checkpoint_dir": str, "profile": str,
             "init_from_hf": str, "profile_steps": str, "metrics_file": str, "tensorboard": str,
             "peak_tflops": float, "routed_scaling_factor": float, "router_groups": int,
             "router_group_topk": int, "shared_expert_ffn": int,
             "microbatch_group_size": int, "data_dtype": str, "pack": str,
             "eos_id": int, "plan": str}  # fmt: skip
_METAVARS = {"checkpoint_dir": "DIR", "profile": "DIR", "tensorboard": "DIR", "profile_steps":
             "A:B", "metrics_file": "FILE", "data": "FILE", "tokenizer": "FILE",
             "hf_config": "FILE", "init_from_hf": "DIR", "peak_tflops": "TFLOPS",
             "collective_timeout": "SECONDS", "router_groups": "N", "router_group_topk": "K",
             "shared_expert_ffn": "N", "routed_scaling_factor": "F",
             "microbatch_group_size": "G", "eos_id": "ID", "plan": "FILE"}  # fmt: skip
_GROUPS = {
    "layout": ("tp", "pp", "dp", "ep", "cp", "cp_attention", "zero", "microbatches", "schedule", "virtual_stages",
               "microbatch_group_size", "recompute", "sequence_parallel", "moe_expert_tp", "overlap_chunks"),
    "model": ("model_type", "hf_config", "vocab_size", "seq_len", "hidden", "heads", "layers",
              "init_from_hf", "ffn", "moe_ffn", "kv_heads", "head_dim", "rope_theta", "qk_norm",
              "attention_bias", "norm", "untied", "moe_every", "experts", "top_k",
              "capacity_factor", "plan"),
    "MoE routing": ("router_score", "routed_scaling_factor", "router_groups",
                    "router_group_topk", "expert_bias", "bias_update_rate", "shared_expert_ffn",
                    "shared_expert_gate", "aux_loss", "aux_loss_coef", "z_loss_coef"),
    "training": ("steps", "batch_size", "fused_ce", "precision", "lr", "min_lr", "warmup", "lr_schedule",
                 "weight_decay", "max_grad_norm", "loss_scale", "seed", "compile", "loss_normalization"),
    "data": ("data", "data_dtype", "tokenizer", "pack", "eos_id", "reset_positions"),
    "checkpoints": ("checkpoint_dir", "save_every", "keep_last", "resume", "allow_fresh",
                    "allow_other_run", "allow_schedule_change"),
    "evaluation": ("eval_every", "eval_batches", "eval_split"),
    "output": ("log_every", "quiet", "metrics_file", "tensorboard", "peak_tflops", "profile",
               "profile_steps"),
    "failures": ("collective_timeout", "max_skipped_steps", "debug_checks"),
}  # fmt: skip
EPILOG = """\
config files:
  --config FILE reads flags from a TOML (.toml) or JSON file: keys are the flags' names
  (batch_size or batch-size; model for --model). Flags on the command line override it. An
  unknown key is an error naming the nearest flag. Every checkpoint directory holds the
  run's resolved settings as train_config.json, itself a --config file.

where fastpar's flags differ from Megatron-LM and torchtitan:
  --batch-size     the GLOBAL batch in sequences (Megatron --global-batch-size; torchtitan
                   counts per data-parallel replica)
  --microbatches   a COUNT of micro-batches per replica and step, not their size (Megatron
                   --micro-batch-size is a size, the count follows from it)
  --tp --pp --dp --ep   sizes (Megatron --tensor-model-parallel-size and so on); --dp may be
                   left out under torchrun
  --zero N         the ZeRO stage (Megatron --use-distributed-optimizer is about stage 1)
  --steps          optimizer steps (Megatron --train-iters)
  --min-lr         defaults to --lr / 10 (Megatron 0); --loss-scale starts at 4096 (Megatron 2^32)
"""


class TrainParser(Parser):
    """The command's parser: ``--config FILE`` is read first (its values become the
    defaults), wherever it stands, so the flags on the command line override it. No prefix
    matching, one-line errors (``fastpar.cliutil.Parser``)."""

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        path = config_file_path(argv)
        if path is not None:
            self.set_defaults(**read_config_file(path))
        return super().parse_known_args(argv, namespace)


def build_parser(
    prog: str = "python -m fastpar.train",
    *,
    description: str = DESCRIPTION,
    epilog: str = EPILOG,
    defaults: dict | None = None,
) -> argparse.ArgumentParser:
    """The parser of the training flags. ``description`` / ``epilog``: the command's own help
    (``fastpar.verify`` has its own); ``defaults``: the command's own defaults ({field: value}),
    shown in --help as the defaults they are."""
    ap = TrainParser(
        prog=prog, description=description, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument(
        "--config", metavar="FILE", default=None,
        help="read flags from a TOML or JSON file; flags given here override it",
    )  # fmt: skip
    own, defaults = dict(defaults or {}), TrainConfig()
    kinds = {f.name: f for f in fields(TrainConfig)}
    placed = [(ap.add_argument_group(title), names) for title, names in _GROUPS.items()]
    rest = tuple(n for n in kinds if not any(n in names for _, names in placed))
    for where, names in [*placed, (ap, rest)]:
        for name in names:
            value, words = getattr(defaults, name), _WORDS.get(name)
            text = _HELP[name].replace("%", "%%")  # argparse formats help with %
            metavar = "{" + ",".join(map(str, words)) + "}" if words else _METAVARS.get(name)
            if name == "recompute":  # a policy; the word alone is full, as it always was
                where.add_argument(
                    flag(name),
                    dest=name,
                    nargs="?",
                    const=True,
                    default=False,
                    metavar="{none,full,attention,mlp,every:K}",
                    help=text,
                )
                where.add_argument("--no-recompute", dest=name, action="store_const",
                                   const=False, help="--recompute none")  # fmt: skip
            elif isinstance(value, bool):
                where.add_argument(flag(name), action=argparse.BooleanOptionalAction,
                                   default=value, help=text)  # fmt: skip
            elif name in _OPTIONAL:
                where.add_argument(
                    flag(name), dest=name, type=_OPTIONAL[name], default=None,
                    metavar=metavar, help=text,
                )  # fmt: skip
            else:
                where.add_argument(
                    flag(name), dest=name, type=type(value), default=value, metavar=metavar,
                    help=text if "default" in text else f"{text} (default %(default)s)",
                )  # fmt: skip
    if own:
        ap.set_defaults(**own)  # before --config FILE's, which override them
    return ap


# -- --config FILE ----------------------------------------------------------------------------
#: a config file's keys: each field's name, its flag's name without the dashes, and "model"
_KEYS = {**{f.name: f.name for f in fields(TrainConfig)},
         **{flag(f.name)[2:]: f.name for f in fields(TrainConfig)}}  # fmt: skip


def config_file_path(argv: list[str]) -> str | None:
    """The FILE of ``--config FILE`` (or ``--config=FILE``) in ``argv``, the last one given."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    return path


def _load(path: str) -> dict:
    """The table of a .toml (tomllib) or .json file; ValueError naming the file."""
    kind = "toml" if path.endswith(".toml") else "json" if path.endswith(".json") else None
    if kind is None:
        raise ValueError(f"--config {path}: name a .toml or a .json file")
    try:
        if kind == "json":
            with open(path) as f:
                raw = json.load(f)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            with open(path, "rb") as f:
                raw = tomllib.load(f)
    except (OSError, ValueError) as exc:  # JSONDecodeError, TOMLDecodeError are ValueErrors
        raise ValueError(f"--config {path}: cannot read it as {kind.upper()} ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: the file must hold a table of flags, not a list")
    return raw


def _flat(raw: dict) -> dict:
    """Tables ([layout], [model], ...: any name) merged into one level."""
    out: dict = {}
    for key, value in raw.items():
        out.update(_flat(value) if isinstance(value, dict) else {key: value})
    return out


def _typed(path: str, key: str, value, kind):
    """``value`` as the field's type (an int is a float too), or ValueError."""
    args = typing.get_args(kind)
    if value is None and type(None) in args:
        return None
    if str in args and isinstance(value, str):  # --recompute: a bool or a policy's name
        return value
    base = next((a for a in args if a is not type(None)), kind) if args else kind
    if base is bool:
        ok = isinstance(value, bool)
    else:
        numeric = (base,) if base is not float else (int, float)
        ok = isinstance(value, numeric) and not isinstance(value, bool)
    if not ok:
        raise ValueError(
            f"--config {path}: {key} = {value!r} must be {base.__name__}"
            + (" or null" if value is None else "")
        )
    return float(value) if base is float else value


def read_config_file(path: str) -> dict:
    """The flags of a TOML or JSON file as {field: value}: keys are the flags' names
    (``batch_size`` or ``batch-size``; ``model`` for --model). An unknown key or a value of the
    wrong type is a ValueError naming the key (and the nearest flag)."""
    hints = typing.get_type_hints(TrainConfig)
    values = {}
    for key, value in _flat(_load(path)).items():
        name = _KEYS.get(key)
        if name is None:
            near = difflib.get_close_matches(key, list(_KEYS), n=1, cutoff=0.6)
            hint = (
                f"did you mean {_KEYS[near[0]]} ({flag(_KEYS[near[0]])})?"
                if near
                else "the keys are the flags' names (python -m fastpar.train --help)"
            )
            raise ValueError(f"--config {path}: unknown key {key!r}: {hint}")
        values[name] = _typed(path, key, value, hints[name])
    return values


# -- the command -------------------------------------------------------------------------------
def _says() -> bool:
    """Whether this process reports a refused run: all but torchrun's local ranks > 0."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def prepare(args: argparse.Namespace):
    """(config, token ids) of parsed flags, every check passed: the flags (``TrainConfig.check``),
    the world size under torchrun (--dp left out follows it) and the data (every id against the
    vocabulary). Raises ValueError / ImportError (one line naming the value and the fix)."""
    world = torchrun_world_size()
    cfg = config_from(args, world)
    if world is not None:
        check_world_size(cfg, world)
    else:
        check_devices(cfg)
    cfg.check()
    tokens = load_data(cfg)
    est = estimate(cfg)
    if est is not None and est.fraction > WARN_FRACTION and _says():
        print(f"warning: {est.describe(cfg)} ({est.fraction:.0%})", file=sys.stderr)
    return cfg, tokens


#: seconds a silent rank (torchrun's local rank > 0) waits before it exits from a refused run
SILENT_RANK_WAIT_S = 20.0


def refuse(exc: Exception) -> int:
    """Print a refused run's one-line error (on local rank 0 only under torchrun); exit code 2.

    The other ranks wait first (``SILENT_RANK_WAIT_S``): torchrun ends every worker as soon as
    one fails, so a silent rank that exited first on a busy machine would kill local rank 0
    before it printed, and the run would end without a word. Rank 0's exit ends them at once."""
    if _says():
        print(f"error: {exc}", file=sys.stderr)
    else:
        time.sleep(SILENT_RANK_WAIT_S)
    return 2


def _note_default_world(cfg, argv: list[str]) -> None:
    """The one-line note of ``default_world_note`` (not under torchrun, not --quiet)."""
    if cfg.quiet or "RANK" in os.environ:
        return
    path = config_file_path(argv)
    given = layout_given(argv, read_config_file(path) if path else None)
    note = default_world_note(cfg, given, cpu_cores())
    if note:
        print(note, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, tokens = prepare(build_parser().parse_args(argv))
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    _note_default_world(cfg, argv)
    try:
        records = launch(cfg, tokens=tokens)
    except RankError as exc:  # a refusal on the ranks (a checkpoint directory, a plan): one line
        if isinstance(exc.exception, (CheckpointError, ValueError, ImportError)):
            return refuse(exc.exception)
        raise
    if records and not cfg.quiet and "RANK" not in os.environ:
        print(done_line(cfg, records))
    return 0
