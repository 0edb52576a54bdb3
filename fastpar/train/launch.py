"""``launch``: run a config on this machine: under torchrun on its ranks, else on ranks started
here by the rank launcher (``fastpar.launch.run_ranks``, the one the CLIs and tests use)."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fastpar import flight
from fastpar.comm import plain
from fastpar.flight.analyse import analyse
from fastpar.flight.files import collect
from fastpar.flight.record import DIR_VAR
from fastpar.launch import RankError, run_ranks
from fastpar.mesh import init
from fastpar.train.batches import load_data
from fastpar.train.checks import check_devices, check_world_size, torchrun_world_size
from fastpar.train.config import TrainConfig
from fastpar.train.loop import run
from fastpar.train.peers import end_stopped_siblings, exit_with_agent
from fastpar.train.stop import RunStopped, StopSignals


# -- launching ---------------------------------------------------------------------------------
def _rank_main(cfg: TrainConfig, tokens=None) -> list[dict]:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return run(cfg, tokens)


def flight_dir(cfg: TrainConfig, temporary: bool = True) -> str | None:
    """Where a failed run's ranks write their flight records: ``FASTPAR_FLIGHT_DIR``, else
    ``flight/`` in --checkpoint-dir, else beside --metrics-file; else a directory in the system's
    temporary one (``temporary``; None: the launcher's own, removed after its analysis)."""
    if os.environ.get(DIR_VAR):
        return os.environ[DIR_VAR]
    if cfg.checkpoint_dir:
        return os.path.join(cfg.checkpoint_dir, "flight")
    if cfg.metrics_file:
        return os.path.join(os.path.dirname(os.path.abspath(cfg.metrics_file)), "flight")
    if not temporary:
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getppid()))
    return os.path.join(tempfile.gettempdir(), f"fastpar-flight-{run}")


def _torchrun_report(where: str, began: float, rank: int, world: int, known: dict) -> None:
    """Under torchrun, after a failed collective: the lowest rank that dumped (within a
    second: the agent ends the other workers once one fails) prints the analysis of every dump there (``known``: ranks it ended, stopped)."""
    others = [r for r in range(world) if r not in known]  # torchrun ends us soon: 1 s at most
    dumps = collect(where, others, timeout=1.0, since=began, settle=0.0)
    full = [d["rank"] for d in dumps if not d.get("partial")]
    if full and rank == min(full):
        text = analyse(dumps, world, known).text()
        print(f"fastpar: flight recorder, {len(full)} dumps in {where}:\n{text}", file=sys.stderr)


def launch(cfg: TrainConfig, timeout: float = 24 * 3600.0, tokens=None) -> list[dict]:
    """Run ``cfg`` on this machine: under torchrun on its ranks, else on ranks started here.
    Returns rank 0's step records. The data are loaded and every id checked first, before any
    rank starts (under torchrun: before the process group); ``tokens`` passes data already
    checked (``load_data``). A stuck rank, a signal: docs/training.md, "When things go wrong";
    the ranks' ``RunStopped`` is raised here."""
    cfg.check()
    if tokens is None:
        tokens = load_data(cfg)
    world = torchrun_world_size()
    if world is not None:
        check_world_size(cfg, world)  # one line; the hint fits --ep
        exit_with_agent()  # a worker never outlives its torchrun agent
        hybrid = dict(dp_shard=cfg.dp_shard, dp_replicate=cfg.dp_replicate)
        where, began, rank = flight_dir(cfg), time.time(), int(os.environ["RANK"])
        flight.arm(where, rank)  # SIGUSR1: this rank's flight records
        init(cfg.tp, cfg.pp, cfg.ep, cp=cfg.cp, timeout=cfg.collective_timeout, **hybrid)
        try:
            records = _rank_main(cfg, tokens)
        except RuntimeError as exc:  # a failed collective: a stopped sibling would hold torchrun
            flight.dump(where, f"{type(exc).__name__}: {exc}"[:2000])
            ended = {r: "stopped: SIGSTOP or a debugger" for r in end_stopped_siblings()}
            _torchrun_report(where, began, rank, world, ended)
            raise
        # every rank is past its last collective, then the groups close in order: a process
        # exiting with live gloo groups while a peer closes its connections can abort
        # ("terminate called without an active exception")
        plain.barrier()
        dist.destroy_process_group()
        return records
    if torch.cuda.is_available():
        check_devices(cfg)
        # spawned ranks load the data again (memory-mapped or re-tokenised), unchecked
        args, how = (cfg,), dict(backend="nccl", start_method="spawn")
    else:  # forked ranks share the parent's tokens
        args, how = (cfg, tokens), {}
    # run_ranks forwards a signal to the ranks, then hands it back to this handler, which only
    # notes it: the ranks' RunStopped says what happened
    with StopSignals():
        try:
            out = run_ranks(
                _rank_main,
                cfg.world_size,
                *args,
                timeout=timeout,
                collective_timeout=cfg.collective_timeout,
                flight_dir=flight_dir(cfg, temporary=False),
                **how,
            )
        except RankError as err:
            if isinstance(err.exception, RunStopped):
                raise err.exception from None
            raise
    return out[0]
