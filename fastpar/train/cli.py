"""``python -m fastpar.train``: the command."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

from fastpar.train.batches import load_data
from fastpar.train.config import build_parser, config_from
from fastpar.train.launch import launch


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from(args)
    try:
        cfg.check()
        tokens = load_data(cfg)  # every id checked against the vocabulary, before any rank
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = launch(cfg, tokens=tokens)
    if records and not cfg.quiet and "RANK" not in os.environ:
        first, last = records[0]["loss"], records[-1]["loss"]
        print(
            f"done: loss {first:.4f} -> {last:.4f} over {len(records)} steps; config {asdict(cfg)}"
        )
    return 0
