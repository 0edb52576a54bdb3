"""``python -m fastpar.train``: the command, its flags (``build_parser``: every flag with its
help and allowed values) and ``--config FILE`` (TOML or JSON; the flags on the command line
override it). Every flag, the data and (under torchrun) the world size are checked before any
rank starts or any process group exists: a bad run ends with one ``error:`` line (one per
machine under torchrun: its local rank 0 says it) and exit code 2."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
import typing

from fastpar.checkpoint import CheckpointError
from fastpar.cliutil import Option, Parser, read_table
from fastpar.launch import RankError
from fastpar.train.batches import load_data
from fastpar.train.checks import (
    SettingsDiffer,
    check_devices,
    check_world_size,
    flag,
    torchrun_world_size,
)
from fastpar.train.config import DESCRIPTION, config_from, flag_specs
from fastpar.train.launch import launch
from fastpar.train.memory import WARN_FRACTION, estimate
from fastpar.train.options import GROUPS
from fastpar.train.peers import exit_with_agent
from fastpar.train.summary import cpu_cores, default_world_note, done_line, layout_given

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
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read flags from a TOML or JSON file; flags given here override it",
    )
    specs = flag_specs()
    for spec in specs:
        if spec.option.group is not None and spec.option.group not in GROUPS:
            raise TypeError(f"the flag {spec.name} needs option(..., group=one of {GROUPS})")
    for title in (*GROUPS, None):  # by section, then the flags' order (the usage line's too)
        where = ap.add_argument_group(title) if title else ap
        for spec in specs:
            if spec.option.group == title:
                _add_flag(where, spec.name, spec.option, spec.default, spec.hint)
    if defaults:
        ap.set_defaults(**defaults)  # before --config FILE's, which override them
    return ap


def _add_flag(where, name: str, opt: Option, value, hint) -> None:
    """The flag of one TrainConfig field, from its ``Option`` (help, words, metavar), its default
    ``value`` and its type ``hint`` (an Optional's value type: ``int`` of ``int | None``)."""
    text = opt.text().replace("%", "%%")  # argparse formats help with %
    metavar = "{" + ",".join(map(str, opt.words)) + "}" if opt.words else opt.metavar
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
        where.add_argument(
            "--no-recompute", dest=name, action="store_const", const=False, help="--recompute none"
        )
    elif isinstance(value, bool):
        where.add_argument(
            flag(name), action=argparse.BooleanOptionalAction, default=value, help=text
        )
    elif value is None or opt.deferred:  # None, or it follows other flags (config_from)
        kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        where.add_argument(
            flag(name), dest=name, type=kind, default=None, metavar=metavar, help=text
        )
    else:
        where.add_argument(
            flag(name),
            dest=name,
            type=type(value),
            default=value,
            metavar=metavar,
            help=text if "default" in text else f"{text} (default %(default)s)",
        )


# -- --config FILE ----------------------------------------------------------------------------
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
    hints = {spec.name: spec.hint for spec in flag_specs()}
    keys = {**{n: n for n in hints}, **{flag(n)[2:]: n for n in hints}}  # batch-size, model
    values = {}
    for key, value in _flat(read_table(path, "--config", holds="flags")).items():
        name = keys.get(key)
        if name is None:
            near = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
            hint = (
                f"did you mean {keys[near[0]]} ({flag(keys[near[0]])})?"
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
    exit_with_agent()  # under torchrun, first of all: a worker never outlives its agent
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
    except SettingsDiffer as exc:  # under torchrun: every rank says it, local rank 0 prints
        return refuse(exc)
    if records and not cfg.quiet and "RANK" not in os.environ:
        print(done_line(cfg, records))
    return 0
