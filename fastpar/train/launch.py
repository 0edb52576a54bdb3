"""``launch``: run a config on this machine: under torchrun on its ranks, else on ranks started here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fastpar.train.batches import load_data
from fastpar.train.config import COLLECTIVE_TIMEOUT_S, TrainConfig
from fastpar.train.loop import run


# -- launching ---------------------------------------------------------------------------------
def _rank_main(cfg: TrainConfig, tokens=None) -> list[dict]:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return run(cfg, tokens)


def launch(cfg: TrainConfig, timeout: float = 24 * 3600.0, tokens=None) -> list[dict]:
    """Run ``cfg`` on this machine: under torchrun on its ranks, else on ranks started here.
    Returns rank 0's step records. The data are loaded and every id checked first, before any
    rank starts (under torchrun: before the process group); ``tokens`` passes data already
    checked (``load_data``)."""
    cfg.check()
    if tokens is None:
        tokens = load_data(cfg)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from fastpar.mesh import init

        if int(os.environ["WORLD_SIZE"]) != cfg.world_size:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but tp*pp*dp = {cfg.tp}*{cfg.pp}*"
                f"{cfg.dp} = {cfg.world_size}; pass --dp {int(os.environ['WORLD_SIZE']) // (cfg.tp * cfg.pp)}"
            )
        from datetime import timedelta

        init(cfg.tp, cfg.pp, cfg.ep, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return _rank_main(cfg, tokens)
    from fastpar.testing import run_ranks

    if torch.cuda.is_available():
        if torch.cuda.device_count() < cfg.world_size:
            raise ValueError(
                f"{cfg.world_size} ranks need {cfg.world_size} GPUs, {torch.cuda.device_count()} visible"
            )
        # spawned ranks load the data again (memory-mapped or re-tokenised), unchecked
        out = run_ranks(
            _rank_main, cfg.world_size, cfg, backend="nccl", start_method="spawn", timeout=timeout
        )
    else:  # forked ranks share the parent's tokens
        out = run_ranks(_rank_main, cfg.world_size, cfg, tokens, timeout=timeout)
    return out[0]
