"""``python -m fastpar.train``: the command. Every flag, the data and (under torchrun) the world
size are checked before any rank starts or any process group exists: a bad run ends with one
``error:`` line (one per machine under torchrun: its local rank 0 says it) and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

from fastpar.checkpoint import CheckpointError
from fastpar.launch import RankError
from fastpar.train.batches import load_data
from fastpar.train.checks import check_devices, check_world_size, torchrun_world_size
from fastpar.train.config import build_parser, config_from
from fastpar.train.launch import launch
from fastpar.train.memory import WARN_FRACTION, estimate


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


def refuse(exc: Exception) -> int:
    """Print a refused run's one-line error (on local rank 0 only under torchrun); exit code 2."""
    if _says():
        print(f"error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, tokens = prepare(build_parser().parse_args(argv))
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    try:
        records = launch(cfg, tokens=tokens)
    except RankError as exc:  # a refusal on the ranks (a checkpoint directory, a plan): one line
        if isinstance(exc.exception, (CheckpointError, ValueError)):
            return refuse(exc.exception)
        raise
    if records and not cfg.quiet and "RANK" not in os.environ:
        first, last = records[0]["loss"], records[-1]["loss"]
        print(
            f"done: loss {first:.4f} -> {last:.4f} over {len(records)} steps; config {asdict(cfg)}"
        )
    return 0
