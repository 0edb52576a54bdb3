"""``python -m fastpar.checkpoint info|verify|export``: inspect, check or export a checkpoint.

    python -m fastpar.checkpoint verify ckpt/step_000010   # every file's size and sha256
    python -m fastpar.checkpoint export ckpt hf_out --hf   # a Hugging Face directory

Its arguments and exit status (0 fine, 1 corrupted or incomplete, 2 bad input):
docs/checkpoints.md ("The command")."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from fastpar.checkpoint.core import verify
from fastpar.checkpoint.directory import scan
from fastpar.checkpoint.export import export_state_dict
from fastpar.checkpoint.format import (
    COMMON,
    MARKER,
    METADATA,
    CheckpointError,
    atomic_torch_save,
    load_bytes,
    read_metadata,
)
from fastpar.checkpoint.format import read_verified as _read_verified
from fastpar.checkpoint.reader import dtype_from
from fastpar.cliutil import Parser


class UsageError(ValueError):
    """Bad input: the message names the value and the fix."""


def resolve(path: str) -> tuple[str, str | None]:
    """(the checkpoint ``path`` names, a note saying which one was picked or None)."""
    if not os.path.exists(path):
        raise UsageError(
            f"{path} does not exist: give a checkpoint directory (step_<N>) or a run's "
            f"--checkpoint-dir"
        )
    if not os.path.isdir(path):
        raise UsageError(f"{path} is a file: give the checkpoint directory that holds it")
    if any(os.path.exists(os.path.join(path, n)) for n in (MARKER, METADATA)):
        return path, None
    entries = scan(path)
    if not entries:
        raise UsageError(
            f"{path} is not a fastpar checkpoint (no {METADATA} nor {MARKER}) and holds no "
            f"step_<N> checkpoints: give a directory written by fastpar.checkpoint.save or "
            f"fastpar.train --checkpoint-dir"
        )
    complete = [e for e in entries if e.status == "complete"]
    if not complete:
        states = ", ".join(f"{e.name} ({e.status}: {e.reason})" for e in entries)
        raise UsageError(f"{path} holds no complete checkpoint: {states}")
    chosen = complete[-1]
    skipped = [e for e in entries if e.status != "complete" and e.step > chosen.step]
    note = f"{path}: using {chosen.name}, the newest complete of {len(entries)} checkpoints"
    if skipped:
        note += "; skipped newer " + ", ".join(f"{e.name} ({e.status})" for e in skipped)
    return chosen.path, note + " (pass a step directory to choose another)"


def _common(path: str, meta: dict) -> dict | None:
    """The common record (step, extra, scaler) if it loads without a full unpickle."""
    try:
        return load_bytes(_read_verified(path, meta["common"]), weights_only=True)
    except Exception:
        return None


def describe(path: str) -> dict:
    """What ``info`` prints, as a dict (``--json``)."""
    meta = read_metadata(path)
    tensors = []
    for name, t in meta["tensors"].items():
        itemsize = dtype_from(t["dtype"]).itemsize
        tensors.append(
            {
                "name": name,
                "shape": t["shape"],
                "dtype": t["dtype"].removeprefix("torch."),
                "bytes": math.prod(t["shape"]) * itemsize,
                "sharding": t.get("sharding", {}).get("kind", "?"),
                "keys": list(t["keys"]),
            }
        )
    files = [*meta["ranks"], meta["common"]]
    common = _common(path, meta)
    extra = (common or {}).get("extra")
    config = extra.get("config") if isinstance(extra, dict) else None
    return {
        "path": os.path.abspath(path),
        "step": meta["step"],
        "run_id": meta.get("run_id"),
        "save_id": meta.get("save_id"),
        "saved_at": meta.get("saved_at"),
        "format": f"{meta['format']} v{meta['version']}",
        "layout": meta["layout"],
        "world_size": meta["layout"].get("world_size"),
        "tensors": tensors,
        "parameter_bytes": sum(t["bytes"] for t in tensors),
        "files": {e["file"]: e["bytes"] for e in files},
        "total_bytes": sum(e["bytes"] for e in files),
        "config": config,
        "config_note": None if common is not None else f"{COMMON} needs a full unpickle",
    }


def _print_info(d: dict) -> None:
    lay = d["layout"]
    mesh = lay.get("mesh")
    where = "no mesh" if not mesh else " ".join(f"{k}={v}" for k, v in mesh.items())
    saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["saved_at"] or 0))
    print(f"checkpoint {d['path']}")
    print(f"  step {d['step']}  run id {d['run_id']}  saved {saved}  ({d['format']})")
    print(f"  layout: world {d['world_size']}, {where}, optimizer {lay.get('optimizer')}")
    print(f"  files: {len(d['files'])}, {d['total_bytes']:,} bytes in all")
    print(f"  tensors: {len(d['tensors'])}, {d['parameter_bytes']:,} bytes of parameters")
    width = max((len(t["name"]) for t in d["tensors"]), default=4)
    for t in d["tensors"]:
        shape = "x".join(map(str, t["shape"])) or "scalar"
        keys = ",".join(t["keys"])
        print(
            f"    {t['name']:<{width}}  {shape:>12}  {t['dtype']:<8} {t['bytes']:>12,} B  "
            f"{t['sharding']:<10} {keys}"
        )
    if d["config"]:
        print("  config: " + " ".join(f"{k}={v}" for k, v in d["config"].items() if v is not None))
    elif d["config_note"]:
        print(f"  config: not shown ({d['config_note']})")
    else:
        print("  config: none stored (not written by fastpar.train)")


def _export(path: str, out: str, fmt: str, hf: bool, tokenizer: str | None) -> int:
    if hf:
        # the run's settings -> an HF family live in the command above this package
        cmd = [sys.executable, "-m", "fastpar.export", path, out]
        cmd += ["--tokenizer", tokenizer] if tokenizer else []
        return subprocess.run(cmd, check=False).returncode
    if os.path.isdir(out):
        raise UsageError(f"{out} is a directory: give the file to write (e.g. {out}/model.pt)")
    state = export_state_dict(path)
    if fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise UsageError(
                "--format safetensors needs the safetensors package: pip install fastpar[hf]"
            ) from e
        save_file({k: v.contiguous() for k, v in state.items()}, out, metadata={"format": "pt"})
    else:
        atomic_torch_save(state, os.path.abspath(out))
    n = sum(v.numel() for v in state.values())
    print(f"exported {path} -> {out} ({fmt}: {len(state)} tensors, {n:,} elements, fp32)")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="python -m fastpar.checkpoint",
        description="Inspect, check or export a fastpar checkpoint.",
        epilog=__doc__.split("\n\n", 2)[2].replace("``", ""),  # plain text, no reST
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="info|verify|export")
    where = "a checkpoint directory, or a directory of step_<N> ones (the newest complete)"
    p = sub.add_parser("info", help="step, run, layout, tensors, bytes, the run's settings")
    p.add_argument("dir", help=where)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p = sub.add_parser("verify", help="check the marker, metadata, every file's size and sha256")
    p.add_argument("dir", help=where)
    p = sub.add_parser("export", help="write the full tensors: .pt, safetensors, or an HF dir")
    p.add_argument("dir", help=where)
    p.add_argument("out", help="the file to write (a directory with --hf)")
    p.add_argument(
        "--format",
        choices=("pt", "safetensors"),
        default="pt",
        help="pt: a torch state_dict {name: fp32 tensor} (torch.load); safetensors: the same "
        "tensors under fastpar's names",
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help="a Hugging Face directory (python -m fastpar.export: needs a fastpar.train run "
        "of --model llama or --hf-config)",
    )
    p.add_argument("--tokenizer", default=None, help="with --hf: tokenizer.json to copy")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        path, note = resolve(args.dir)
        if note:
            print(note, file=sys.stderr)
        if args.command == "info":
            d = describe(path)
            print(json.dumps(d, indent=1)) if args.json else _print_info(d)
            return 0
        if args.command == "verify":
            try:
                meta = verify(path)
            except CheckpointError as e:
                print(f"CORRUPTED: {e}", file=sys.stderr)
                return 1
            total = sum(e["bytes"] for e in [*meta["ranks"], meta["common"]])
            print(
                f"OK {os.path.abspath(path)}: step {meta['step']}, {len(meta['ranks'])} rank "
                f"files + {COMMON}, {total:,} bytes, every sha256 matches"
            )
            return 0
        if args.hf and args.format != "pt":
            raise UsageError("--hf writes safetensors already: drop --format")
        return _export(path, args.out, args.format, args.hf, args.tokenizer)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
