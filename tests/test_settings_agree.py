"""Every rank's resolved settings are compared across the world before the first step: ranks
started with different flags (two torchrun nodes with another --lr) stop with one error naming
the setting and the ranks, instead of training apart (under --zero 0 the replicas would end with
different weights, both exiting 0)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

import pytest

from fastpar.testing import run_ranks
from fastpar.train import TrainConfig
from fastpar.train.checks import SettingsDiffer, check_same_settings

SMALL = dict(steps=2, batch_size=4, seq_len=16, hidden=32, heads=4, layers=2, quiet=True)


def _check(lrs) -> str:
    import torch.distributed as dist

    cfg = TrainConfig(**SMALL, tp=1, pp=1, dp=len(lrs), ep=1, moe_every=0)
    cfg = dataclasses.replace(cfg, lr=lrs[dist.get_rank()])
    try:
        check_same_settings(cfg)
    except SettingsDiffer as exc:
        return str(exc)
    return "agree"


def test_the_same_settings_pass_and_a_difference_names_the_flag_and_the_ranks():
    assert run_ranks(_check, 2, [3e-3, 3e-3]) == ["agree", "agree"]
    out = run_ranks(_check, 4, [3e-3, 3e-3, 1e-3, 3e-3])
    assert len(set(out)) == 1, out  # every rank says the same
    assert "--lr is 0.003 on ranks 0-1, 3; 0.001 on rank 2" in out[0], out[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "lr", ["1e-3", pytest.param("3e-3", marks=pytest.mark.slow)], ids=["other-lr", "same-lr"]
)
def test_two_torchrun_nodes_with_different_flags_stop_before_the_first_step(lr):
    """Two torchrun agents on 127.0.0.1 (--nnodes 2, c10d rendezvous), one rank each: with
    another --lr on node 1 both end with the one-line refusal (exit 2); with the same, 0."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    flags = ["--dp", "2", "--tp", "1", "--pp", "1", "--ep", "1", "--moe-every", "0", "--zero", "0"]
    flags += [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
        for k, v in SMALL.items()
    ]
    procs = []
    for node, node_lr in ((0, "3e-3"), (1, lr)):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"agree{port}",
            "-m",
            "fastpar.train",
            *flags,
            "--lr",
            node_lr,
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    outs = [p.communicate(timeout=240) for p in procs]
    codes = [p.returncode for p in procs]
    text = "\n".join(o + e for o, e in outs)
    if lr == "3e-3":
        assert codes == [0, 0], text[-3000:]
        return
    assert codes != [0, 0], text[-3000:]
    assert "--lr is 0.003 on rank 0; 0.001 on rank 1" in text, text[-3000:]
    assert "error: the ranks were started with different settings" in text
    # one line from fastpar (torchrun then reports its child's exit code as it does)
    assert not [line for line in text.splitlines() if "fastpar/train" in line], text[-3000:]
