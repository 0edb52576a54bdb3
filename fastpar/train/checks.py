"""Checks of a run's flags before any rank starts: each value within the bound its option declares
(``check_bounds``), the few rules the world-size hint needs first (--top-k, the LR schedule, the
flags that need --checkpoint-dir), the world size under torchrun (whose hint is a layout that itself
passes every check) and the ranks' settings alike. Each failure is one ValueError line naming the
value and the fix; the rules that relate several flags are ``fastpar.train.config_checks``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

import torch.distributed as dist

from fastpar.comm import plain

#: --lr-schedule: what comes after the warm-up
LR_SCHEDULES = {
    "cosine": "cosine decay from --lr to --min-lr over the remaining steps",
    "constant": "--lr to the end",
}

#: flags that only mean something with --checkpoint-dir
NEED_CHECKPOINT_DIR = (
    *("resume", "save_every", "keep_last", "allow_fresh", "allow_other_run"),
    "allow_schedule_change",
)
#: the seed enters the batch generator as seed * 1_000_003 + step (a 64-bit seed)
SEED_LIMIT = 2**43
#: the longest --collective-timeout (datetime.timedelta overflows near 8.6e13 s)
TIMEOUT_LIMIT = 1e9
TIMEOUT_ENV = "FASTPAR_COLLECTIVE_TIMEOUT"


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


def flag(name: str) -> str:
    """The command-line flag of a TrainConfig field."""
    return "--model" if name == "model_type" else "--" + name.replace("_", "-")


def check_bounds(cfg) -> None:
    """Every flag within the bound its option declares (``Option.out_of_bounds``)."""
    for name, opt, value in cfg.flag_items():
        if error := opt.out_of_bounds(flag(name), value):
            raise ValueError(error)


def _check_collective_timeout(cfg) -> None:
    """A --collective-timeout out of its bound that came from FASTPAR_COLLECTIVE_TIMEOUT names
    the variable."""
    value, raw = cfg.collective_timeout, os.environ.get(TIMEOUT_ENV)
    if raw is None or (math.isfinite(value) and value > 0):
        return
    try:
        from_env = float(raw) == value or math.isnan(value)
    except ValueError:
        from_env = True
    if from_env:
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds: set it to one (e.g. "
            f"300), or pass --collective-timeout SECONDS"
        )


def check_ranges(cfg) -> None:
    """Every flag within its bound, then the rules of a few (each a function named after it)."""
    _check_collective_timeout(cfg)
    check_bounds(cfg)
    check_top_k(cfg)
    check_lr_schedule(cfg)
    check_paths(cfg)


def check_top_k(cfg) -> None:
    """Each token picks --top-k distinct experts of --experts."""
    model = cfg.model
    if model is not None and model.moe_every and model.top_k > model.num_experts:
        top_k, experts = model.top_k, model.num_experts
        raise ValueError(
            f"--top-k {top_k} exceeds --experts {experts}: each token picks top_k "
            f"distinct experts; use --top-k <= {experts} or more --experts"
        )


def check_lr_schedule(cfg) -> None:
    """--lr-schedule one fastpar knows; under cosine, --min-lr not above --lr."""
    if cfg.lr_schedule not in LR_SCHEDULES:
        words = "; ".join(f"{k}: {v}" for k, v in LR_SCHEDULES.items())
        raise ValueError(
            f"--lr-schedule {cfg.lr_schedule!r} is not a schedule fastpar knows: pass one of "
            f"{' or '.join(LR_SCHEDULES)} ({words})"
        )
    if cfg.lr_schedule == "cosine" and cfg.min_lr is not None and cfg.min_lr > cfg.lr:
        raise ValueError(
            f"--min-lr {cfg.min_lr:g} is above --lr {cfg.lr:g}: the cosine schedule would raise "
            f"the rate; pass a --min-lr <= {cfg.lr:g} (e.g. {cfg.lr / 10:g}), or --lr-schedule "
            f"constant"
        )


def check_devices(cfg) -> None:
    """Self-started ranks on GPUs need one GPU each."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < cfg.world_size:
        raise ValueError(
            f"{cfg.world_size} ranks need {cfg.world_size} GPUs, {torch.cuda.device_count()} "
            f"visible: use a layout of at most {torch.cuda.device_count()} ranks, or torchrun "
            f"over several machines"
        )


def check_paths(cfg) -> None:
    """The flags that need --checkpoint-dir have it; the directories are not files."""
    if not cfg.checkpoint_dir:
        for name in NEED_CHECKPOINT_DIR:
            value = getattr(cfg, name)
            if value:
                given = flag(name) if value is True else f"{flag(name)} {value}"
                raise ValueError(
                    f"{given} needs --checkpoint-dir DIR (where the run's checkpoints are "
                    f"written and read): add it, or drop {flag(name)}"
                )
    for name in ("checkpoint_dir", "profile"):
        path = getattr(cfg, name)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag(name)} {path} is a file, not a directory: pass a directory")


# -- the world size under torchrun --------------------------------------------------------------
def torchrun_world_size() -> int | None:
    """WORLD_SIZE when this process is a torchrun rank (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def infer_dp(tp: int, pp: int, world: int | None, default: int) -> int:
    """--dp when it is not given: world / (tp * pp) under torchrun (when that divides; else the
    world-size check explains), else ``default``."""
    if world is None or tp < 1 or pp < 1 or world % (tp * pp):
        return default
    return world // (tp * pp)


def node_local_shard(values: dict) -> dict:
    """``values`` with --dp-shard set to one node's dp ranks (LOCAL_WORLD_SIZE / (tp*cp)) when
    torchrun spans several nodes (WORLD_SIZE > LOCAL_WORLD_SIZE), a ZeRO stage shards, neither
    --dp-shard nor --dp-replicate was given, and a node holds a whole number of dp ranks, fewer
    than dp: the shard group is then node-local (hybrid sharding, as torchtitan's HSDP). Else
    unchanged (one node: full sharding)."""
    if values.get("dp_shard") is not None or values.get("dp_replicate") is not None:
        return values
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if not values.get("zero") or not (world or "").isdigit() or not (local or "").isdigit():
        return values
    tp_cp, dp = values["tp"] * (values.get("cp") or 1), values["dp"]
    per_node = int(local) // tp_cp if int(local) % tp_cp == 0 else 0
    if int(local) >= int(world) or per_node < 1 or per_node >= dp or dp % per_node:
        return values
    return {**values, "dp_shard": per_node}


def _passes(cfg) -> bool:
    try:
        cfg.check()
    except ValueError:
        return False
    return True


def _nearest(divisors: list[int], value: int) -> list[int]:
    """``divisors`` in the order to try them instead of ``value``: itself, then the smaller
    ones (nearest first), then the larger ones."""
    return sorted(divisors, key=lambda d: (d != value, d > value, abs(d - value)))


def _fitting(cfg, world: int) -> dict | None:
    """The first layout of ``world`` ranks, each of tp, pp, ep as near the given one as it
    can be, with which ``cfg`` passes every check; None if none does."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp in _nearest(divisors, cfg.tp):
        for pp in _nearest([d for d in divisors if (world // tp) % d == 0], cfg.pp):
            dp = world // (tp * pp)
            for ep in _nearest([e for e in range(1, dp + 1) if dp % e == 0], cfg.ep):
                layout = dict(tp=tp, pp=pp, dp=dp, ep=ep)
                if _passes(dataclasses.replace(cfg, **layout)):
                    return layout
    return None


def check_world_size(cfg, world: int) -> None:
    """Under torchrun: raise ValueError (one line) unless tp * pp * dp is the ``world`` torchrun
    started and ep divides dp, with the flags that make it fit (a layout that passes every
    check, --ep included)."""
    check_ranges(cfg)  # tp, pp, dp, ep >= 1 first
    if cfg.world_size == world and (cfg.dp * cfg.cp) % cfg.ep == 0:
        return
    if cfg.cp > 1:
        raise ValueError(
            f"torchrun started {world} ranks but tp*cp*pp*dp = {cfg.tp}*{cfg.cp}*{cfg.pp}*"
            f"{cfg.dp} = {cfg.world_size} (or ep {cfg.ep} does not divide dp*cp): pass --dp "
            f"{world // (cfg.tp * cfg.cp * cfg.pp) or 1} or start {cfg.world_size} ranks"
        )
    dp = world // (cfg.tp * cfg.pp) if world % (cfg.tp * cfg.pp) == 0 else None
    if dp is None:
        what = (
            f"torchrun started {world} ranks, not a multiple of tp*pp = {cfg.tp}*{cfg.pp} = "
            f"{cfg.tp * cfg.pp}"
        )
    elif cfg.world_size != world:
        what = (
            f"torchrun started {world} ranks but tp*pp*dp = {cfg.tp}*{cfg.pp}*{cfg.dp} = "
            f"{cfg.world_size}"
        )
    else:
        what = f"torchrun started {world} ranks: dp = {dp}, which ep {cfg.ep} does not divide"
    layout = _fitting(cfg, world)
    if layout is None:
        raise ValueError(
            f"{what}; no tp x pp x dp layout of {world} ranks fits this model and batch: start "
            f"another number of ranks (--nproc-per-node x --nnodes)"
        )
    changed = " ".join(f"--{k} {v}" for k, v in layout.items() if k == "dp" or v != getattr(cfg, k))
    # the given layout as it is, on the number of ranks it makes
    other = f", or start {cfg.world_size} ranks" if _passes(cfg) else ""
    raise ValueError(
        f"{what}: pass {changed} (--dp may be left out: it follows the world size){other}"
    )


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"."""
    spans, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None], strict=True):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


class SettingsDiffer(ValueError):
    """The ranks were started with different settings (``check_same_settings``)."""


def check_same_settings(cfg) -> None:
    """Every rank's resolved settings (every TrainConfig field: model, layout, optimizer,
    schedule, data, seed, precision) against every other's, before the first step: one small
    all-gather of a digest (and, only when they differ, of the settings, to name them).
    ValueError on every rank naming the first differing setting and which ranks hold which
    value; torchrun nodes started with different flags would otherwise train silently apart."""
    mine = {k: repr(v) for k, v in cfg.flags().items()}
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    world = dist.get_world_size()
    digests: list = [None] * world
    plain.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    every: list = [None] * world
    plain.all_gather_object(every, mine)
    for name in mine:
        values: dict[str, list[int]] = {}
        for rank, settings in enumerate(every):
            values.setdefault(settings.get(name, "<absent>"), []).append(rank)
        if len(values) > 1:
            held = "; ".join(f"{v} on {_ranks_text(r)}" for v, r in values.items())
            raise SettingsDiffer(
                f"the ranks were started with different settings: {flag(name)} is {held}; "
                f"start every node (every torchrun agent) with the same flags and config file"
            )
