"""A run's checkpoints in ``--checkpoint-dir``: one writer at a time, a run id, resume that names
what it skips, changed settings refused or warned, ``--keep-last``. ``run`` calls
``open_checkpoints`` before the first step, ``_save`` at each save and ``close_checkpoints`` at
the end, on every rank (docs/training.md, "Inside fastpar.train"; docs/checkpoints.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import secrets
import shutil
import sys
import time

import torch.distributed as dist

from fastpar.checkpoint.core import _agree
from fastpar.checkpoint.directory import prune, scan, step_dir
from fastpar.checkpoint.format import PARTIAL_SUFFIX, CheckpointError
from fastpar.checkpoint.lock import DirectoryLock, describe
from fastpar.cliutil import os_error_text
from fastpar.comm import plain
from fastpar.models import native
from fastpar.train.batches import SCHEDULE_FIELDS, lr_at
from fastpar.train.build import Trainer
from fastpar.train.checks import flag
from fastpar.train.config import flag_specs
from fastpar.train.stop import RunStopped

#: the run's resolved settings (every TrainConfig field) in each checkpoint directory
CONFIG_FILE = "train_config.json"


def _resume(kind: str) -> tuple[str, ...]:
    """The flags whose ``Option.resume`` is ``kind``, in declaration order."""
    return tuple(spec.name for spec in flag_specs() if spec.option.resume == kind)


#: the fields whose change a resume refuses (they define the model) and warns about (the run
#: leaves its trajectory), from ``option(resume=...)``: docs/checkpoints.md, "Resuming"
REFUSED = _resume("refuse")
WARNED = _resume("warn")


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def _model_record(cfg) -> dict:
    """What defines the model beyond the flags: the vocabulary, the --hf-config content."""
    from fastpar.models.hf import read_config_json

    hf = read_config_json(cfg.hf_config) if cfg.hf_config else None
    if hf is not None:
        hf = {k: v for k, v in hf.items() if k not in ("transformers_version", "_name_or_path")}
    return {"vocab": cfg.vocab, "hf_config": hf}


def _normalised(old: dict) -> dict:
    """A checkpoint's flags as this code holds them (its model's through its config: an
    ``aux_loss`` "none" is None); keys this code does not know kept as they are."""
    config, other = native.config_from_flags(old.get("model_type", "gpt"), old, vocab_size=256)
    now = native.flags_of(config, other) if config is not None else {}
    return {**old, **{k: v for k, v in now.items() if k in old}}


def compare_settings(saved: dict, cfg) -> tuple[list[str], list[str]]:
    """(refused, warned) differences between a checkpoint's ``extra`` and the run's ``cfg``,
    each "--flag OLD -> NEW" (see ``REFUSED`` / ``WARNED`` for which is which and why)."""
    old, now = _normalised(saved.get("config") or {}), cfg.flags()
    refused_fields = REFUSED + (
        ("seq_len",) if not cfg.hf_config and native.get(cfg.model_type).learned_positions else ()
    )

    def diff(names):
        out = [f"{flag(n)} {old[n]} -> {now[n]}" for n in names if n in old and old[n] != now[n]]
        return sorted(out)

    refused = [] if cfg.hf_config else diff(refused_fields)
    bin_data = (cfg.data or "").endswith(".bin")  # --data-dtype means nothing for other data
    warned = diff(n for n in WARNED if n not in refused_fields and (n != "data_dtype" or bin_data))
    model = saved.get("model") or {}
    if model.get("vocab") is not None and model["vocab"] != cfg.vocab:
        refused.append(f"vocabulary {model['vocab']} -> {cfg.vocab}")
    if cfg.hf_config and "hf_config" in model:
        was, new = model["hf_config"] or {}, _model_record(cfg)["hf_config"]
        keys = sorted(k for k in set(was) | set(new) if was.get(k) != new.get(k))
        refused += [f"--hf-config {k}: {was.get(k)!r} -> {new.get(k)!r}" for k in keys]
    return refused, warned


def compare_schedule(saved: dict, cfg, step: int) -> tuple[str, str, bool] | None:
    """None when the checkpoint's ``SCHEDULE_FIELDS`` equal ``cfg``'s; else (each changed flag
    "OLD -> NEW"; the LR of the next two steps, saved -> new, numbered as the log line counts
    steps; whether the LR of any step from ``step`` to both settings' end differs)."""
    old = saved.get("config") or {}
    changed = [n for n in SCHEDULE_FIELDS if n in old and old[n] != getattr(cfg, n)]
    if not changed:
        return None
    before = dataclasses.replace(cfg, **{n: old[n] for n in changed})
    end = min(before.steps, cfg.steps)
    if cfg.steps > step:  # the step the run goes on with, even past the saved run's end
        end = max(end, step + 1)
    moved = any(lr_at(before, s) != lr_at(cfg, s) for s in range(step, end))
    flags = "; ".join(f"{flag(n)} {old[n]} -> {getattr(cfg, n)}" for n in changed)
    rates = f"LR at step {step + 1}: {lr_at(before, step):.6g} -> {lr_at(cfg, step):.6g}"
    if cfg.steps > step + 1:
        rates += (
            f", at step {step + 2}: {lr_at(before, step + 1):.6g} -> {lr_at(cfg, step + 1):.6g}"
        )
    return flags, rates, moved


def write_config_file(cfg, path: str) -> None:
    """``cfg``'s resolved settings as a JSON ``--config`` file (written whole, then renamed;
    when that fails, nothing is left behind and the ``OSError`` names ``path``)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(cfg.flags(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise OSError(e.errno, e.strerror, path) from None


def _new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def _choose(root: str, our_run: str | None, entries) -> tuple[str | None, list[str]]:
    """(the newest usable checkpoint of ``our_run``, the newer ones skipped with why)."""
    from fastpar.checkpoint import verify

    skipped = []
    for e in reversed(entries):
        why = {"incomplete": "incomplete", "corrupted": "corrupted"}.get(e.status)
        if why is None and our_run is not None and e.run_id != our_run:
            why = f"another run's (run {e.run_id!r}, this directory's run is {our_run!r})"
        if why is None:
            try:
                verify(e.path)
                return e.path, skipped
            except CheckpointError as err:
                why, e.reason = "corrupted", str(err).split(": ", 1)[-1]
        skipped.append(f"{e.name}: {why}" + (f" ({e.reason})" if e.reason else ""))
    return None, skipped


def _plan_resume(trainer: Trainer, previous: dict | None, entries) -> tuple[str, str | None]:
    """Rank 0: (run id, checkpoint to load or None) for --resume; prints what it skips."""
    from fastpar.checkpoint import CheckpointReader

    cfg, root = trainer.cfg, trainer.cfg.checkpoint_dir
    our_run = (previous or {}).get("last_run")
    if our_run is None:  # no lock record: the run of the most recently saved checkpoint
        done = [e for e in entries if e.status == "complete"]
        our_run = max(done, key=lambda e: e.saved_at).run_id if done else None
    path, skipped = _choose(root, our_run, entries)
    for line in skipped:
        _warn(f"--resume: skipping {os.path.join(root, line)}")
    if path is None:
        what = f" ({'; '.join(skipped)})" if skipped else ""
        if not cfg.allow_fresh:
            raise CheckpointError(
                f"--resume: {root} holds no usable checkpoint{what}; pass --allow-fresh to "
                f"start from step 0, or drop --resume"
            )
        _warn(
            f"--resume: no usable checkpoint in {root}{what}; starting from step 0 (--allow-fresh)"
        )
        return our_run or _new_run_id(), None
    reader = CheckpointReader(path)
    try:
        common = reader.common()
    finally:
        reader.release()
    extra, step = common.get("extra") or {}, int(common["step"])
    refused, warned = compare_settings(extra, cfg)
    if refused:
        raise CheckpointError(
            f"--resume: {path} was saved with another model ({'; '.join(refused)}); resume "
            f"with the checkpoint's settings, or start a new run in another --checkpoint-dir"
        )
    if warned:
        _warn(
            f"--resume from {path} with changed settings: {'; '.join(warned)} (the run goes "
            "on, but not as the saved run would have)"
        )
    if cfg.steps < step:
        raise CheckpointError(
            f"--steps {cfg.steps} is below the step {step} of {path}: pass --steps above "
            f"{step} to train on from there"
        )
    _judge_schedule(cfg, extra, step, path)
    return extra.get("run_id") or our_run or _new_run_id(), path


def _judge_schedule(cfg, extra: dict, step: int, path: str) -> None:
    """Rank 0, --resume: refuse a changed LR schedule unless --allow-schedule-change (then
    warn); a change that moves no step's LR is one note (the run's end moved)."""
    change = compare_schedule(extra, cfg, step)
    if change is None:
        return
    flags, rates, moved = change
    text = f"--resume from {path} changes the LR schedule ({flags}): {rates} (saved -> new)"
    if moved and not cfg.allow_schedule_change:
        raise CheckpointError(
            f"{text}; resume with the saved values, or pass --allow-schedule-change to train on "
            "with the new schedule"
        )
    if moved:
        _warn(f"{text}; training on with the new schedule (--allow-schedule-change)")
    elif not cfg.quiet:
        was = (extra.get("config") or {}).get("steps", cfg.steps)
        end = f"; the run now ends at step {cfg.steps}" if was != cfg.steps else ""
        print(
            f"note: --resume from {path}: {flags} leaves the LR of every step both settings "
            f"train unchanged{end}",
            flush=True,
        )


def _plan_fresh(trainer: Trainer, entries) -> str:
    """Rank 0: a new run id; refuses a directory holding another run's checkpoints."""
    cfg, root = trainer.cfg, trainer.cfg.checkpoint_dir
    theirs = [e for e in entries if not e.path.endswith(".partial")]
    if theirs:
        runs = sorted({str(e.run_id) for e in theirs if e.status == "complete"})
        what = f"{len(theirs)} checkpoints, {theirs[0].name} to {theirs[-1].name}" + (
            f", of run {', '.join(runs)}" if runs else ""
        )
        if not cfg.allow_other_run:
            raise CheckpointError(
                f"--checkpoint-dir {root} holds another run's checkpoints ({what}): pass "
                f"--resume to continue that run, --allow-other-run to write beside them, or use "
                f"an empty directory"
            )
        _warn(
            f"{root} holds another run's checkpoints ({what}); writing beside them "
            "(--allow-other-run)"
        )
    return _new_run_id()


def _refuse_collisions(cfg, entries, run_id: str, start: int) -> None:
    """Another run's checkpoint is never overwritten: refuse, before the first step, a run that
    would save a step another run saved in this directory (--allow-other-run writes beside
    other runs' checkpoints, not over them)."""
    every = range(cfg.save_every, cfg.steps + 1, cfg.save_every) if cfg.save_every else ()
    planned = {s for s in (*every, cfg.steps) if s > start}  # every --save-every, and the last
    clash = [e for e in entries if e.run_id not in (None, run_id) and e.step in planned]
    if clash:
        names = ", ".join(e.name for e in clash[:3]) + (", ..." if len(clash) > 3 else "")
        raise CheckpointError(
            f"--checkpoint-dir {cfg.checkpoint_dir}: this run would save over another run's "
            f"checkpoints ({names}, run {clash[0].run_id!r}), which are never overwritten: use "
            f"an empty directory, or --steps / --save-every that miss those steps"
        )


def _plan(trainer: Trainer) -> tuple[str, str | None]:
    """Rank 0: take the lock, then decide (run id, checkpoint to load)."""
    cfg = trainer.cfg
    lock = DirectoryLock(cfg.checkpoint_dir, None)
    previous = lock.acquire()
    trainer._checkpoint_lock = lock
    try:
        if lock.taken_over:
            _warn(
                f"{cfg.checkpoint_dir}: taking over the lock of {describe(previous)}, which "
                "ended without releasing it"
            )
        entries = scan(cfg.checkpoint_dir)
        if cfg.resume:
            run_id, path = _plan_resume(trainer, previous, entries)
        else:
            run_id, path = _plan_fresh(trainer, entries), None
        start = next((e.step for e in entries if e.path == path), 0)
        _refuse_collisions(cfg, entries, run_id, start)
        lock.update(run_id=run_id)
        # the run's settings, one file in the run's directory (here: a full disk is the one
        # line every rank raises, not rank 0's alone)
        write_config_file(cfg, os.path.join(cfg.checkpoint_dir, CONFIG_FILE))
    except BaseException:
        close_checkpoints(trainer)
        raise
    return run_id, path


def _refusal(e: Exception, root: str) -> str:
    """The one line every rank raises when rank 0 could not open ``root`` for the run."""
    if isinstance(e, CheckpointError):
        return str(e)
    if not (isinstance(e, OSError) and e.errno):
        return f"--checkpoint-dir {root}: {type(e).__name__}: {e}"
    text = f"--checkpoint-dir {root}: {e.filename or root}: {os_error_text(e)}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):
            text += f" ({shutil.disk_usage(root).free / 2**20:.1f} MiB are free there)"
        text += ": free some space, or pass another --checkpoint-dir"
    return text


def open_checkpoints(trainer: Trainer, talk: bool) -> int:
    """Every rank, before the first step: lock the checkpoint directory, fix the run id and
    resume (see docs/training.md). Returns the step to start from (0 without
    --checkpoint-dir). Raises ``CheckpointError`` on every rank when the run must not go on."""
    cfg = trainer.cfg
    if not cfg.checkpoint_dir:
        return 0
    if getattr(trainer, "_checkpoints_open", None) is not None:
        return trainer._checkpoints_open
    decision: list = [None]
    if dist.get_rank() == 0:
        try:
            decision[0] = ("ok", *_plan(trainer))
        except Exception as e:  # the others wait in the broadcast: tell them, whatever it is
            decision[0] = ("error", _refusal(e, cfg.checkpoint_dir), None)
    plain.broadcast_object_list(decision, src=0)
    status, first, path = decision[0]
    if status == "error":
        raise CheckpointError(first)
    trainer.run_id = first
    start = _load(trainer, path, talk) if path else 0
    trainer._checkpoints_open = start
    return start


def _load(trainer: Trainer, path: str, talk: bool) -> int:
    from fastpar import checkpoint

    error = None
    ctx = trainer.model.summon_full_params() if trainer.cfg.zero == 3 else contextlib.nullcontext()
    try:
        with ctx:
            info = checkpoint.load(
                path,
                model_params=trainer.checkpoint_tensors(),
                optimizer=trainer.opt,
                mesh=trainer.mesh,
            )
    except Exception as e:
        error = e
    if not _agree(error is None):
        raise error or CheckpointError(f"another rank failed to load {path}")
    cfg, trainer.step_count = trainer.cfg, int(info["step"])
    if talk:
        done = "; --steps reached: nothing to train" if trainer.step_count >= cfg.steps else ""
        hf = cfg.init_from_hf
        won = f"; its weights and optimizer state replace --init-from-hf {hf}'s" if hf else ""
        line = f"resume: {path} (step {trainer.step_count}, run {trainer.run_id}){won}{done}"
        print(line, flush=True)
    return trainer.step_count


class SaveFailed(RunStopped):
    """A checkpoint could not be written (a full disk, a lost mount): the run ends, exit 1,
    with one line naming the path, the cause, the bytes needed and free; earlier checkpoints
    are untouched and the failed save's partial directory is removed."""


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _save_failed(exc: BaseException, trainer: Trainer, root: str, step: int) -> str:
    """Every rank: the one line of a failed save, the same on every rank (one all-gather names
    the rank whose write failed and its errno; rank 0 removes the partial directory, measures
    what is free and broadcasts the line)."""
    mine = (exc.errno, exc.filename) if isinstance(exc, OSError) and exc.errno else None
    every: list = [None] * dist.get_world_size()
    plain.all_gather_object(every, mine)
    line: list = [None]
    if dist.get_rank() == 0:
        found = next(((r, e) for r, e in enumerate(every) if e is not None), None)
        path = step_dir(root, step)
        if found is None:
            why = f"{type(exc).__name__}: {exc}"
        else:
            rank, (code, filename) = found
            name = errno.errorcode.get(code, str(code))
            why = f"{os.strerror(code)} ({name}) writing {filename or path} on rank {rank}"
        shutil.rmtree(path + PARTIAL_SUFFIX, ignore_errors=True)  # the failed save's shards
        done = [e for e in scan(root) if e.status == "complete" and e.step != step]
        # about what one checkpoint takes: the newest complete one, else the tensors held
        held = sum(t.numel() * t.element_size() for t in trainer.checkpoint_tensors().values())
        needed = _dir_bytes(done[-1].path) if done else 3 * held * dist.get_world_size()
        free = shutil.disk_usage(root).free
        kept = (
            f"the previous checkpoint {done[-1].path} is kept" if done else "nothing saved before"
        )
        line[0] = (
            f"saving step {step} to {path} failed: {why}; a checkpoint needs about "
            f"{needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free on {root}; {kept}"
        )
    plain.broadcast_object_list(line, src=0)
    return line[0]


def _copy_settings(cfg, path: str) -> None:
    """Rank 0, once ``path`` is complete: the run's settings beside it (``CONFIG_FILE``). The
    checkpoint holds them too (``extra["config"]``), so a disk that filled up in between is a
    warning, not a failed save: the checkpoint is whole and the next save meets the full disk."""
    try:
        write_config_file(cfg, os.path.join(path, CONFIG_FILE))
    except OSError as e:
        _warn(
            f"{path} is complete, but its {CONFIG_FILE} could not be written: {os_error_text(e)}; "
            "the checkpoint holds the same settings"
        )


def _save(trainer: Trainer, root: str, step: int, talk: bool) -> bool:
    """Save ``step`` (every rank); False when it failed under --on-save-error continue."""
    from fastpar import checkpoint

    open_checkpoints(trainer, talk)  # a no-op when run() opened them before the first step
    lock, error = getattr(trainer, "_checkpoint_lock", None), None
    if lock is not None:
        try:
            lock.check()
            # another run's checkpoint of this step? (a stop's save: an unplanned step)
            found = next((e for e in scan(root) if e.step == step), None)
            if found is not None and found.run_id not in (None, trainer.run_id):
                raise CheckpointError(
                    f"not saving step {step}: {step_dir(root, step)} is run {found.run_id!r}'s "
                    "checkpoint, which is never overwritten"
                )
        except CheckpointError as e:
            error = e
    if not _agree(error is None):
        raise error or CheckpointError(f"rank 0 could not save step {step} in {root}")
    cfg, path = trainer.cfg, step_dir(root, step)
    extra = {
        "step": step,
        "config": cfg.flags(),
        "run_id": trainer.run_id,
        "model": _model_record(cfg),
    }
    ctx = trainer.model.summon_full_params() if cfg.zero == 3 else contextlib.nullcontext()
    try:
        with ctx:
            checkpoint.save(
                path,
                model_params=trainer.checkpoint_tensors(),
                optimizer=trainer.opt,
                mesh=trainer.mesh,
                step=step,
                extra=extra,
                overwrite=True,
                run_id=trainer.run_id,
            )
    except (OSError, CheckpointError) as exc:  # (every rank: the save agrees on failing)
        text = _save_failed(exc, trainer, root, step)
        if cfg.on_save_error == "continue" and step < cfg.steps:
            if dist.get_rank() == 0:  # (the same line on every rank: said once)
                _warn(f"{text}; training on (--on-save-error continue), the next save retries")
            return False
        raise SaveFailed(text, step, "save failed") from None
    if dist.get_rank() == 0:
        _copy_settings(cfg, path)
    if talk:
        print(f"checkpoint: {path}", flush=True)
    if lock is not None and cfg.keep_last > 0:
        deleted, busy = prune(root, cfg.keep_last, run_id=trainer.run_id, protect=path)
        if talk and deleted:
            print(f"checkpoint: --keep-last {cfg.keep_last} deleted {len(deleted)}", flush=True)
        for p in busy:
            _warn(f"--keep-last: kept {p}: it is being read")
    if step >= cfg.steps:
        close_checkpoints(trainer)
    return True


def close_checkpoints(trainer: Trainer) -> None:
    """Every rank, at the end of the run (idempotent): rank 0 releases the directory's lock."""
    lock = getattr(trainer, "_checkpoint_lock", None)
    if lock is not None:
        lock.release()
        trainer._checkpoint_lock = None
