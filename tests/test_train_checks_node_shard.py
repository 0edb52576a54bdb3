"""Hybrid sharding as torchrun starts it on several nodes: --dp-shard left out under a
multi-node torchrun is one node's dp ranks (the shard group node-local); two torchrun agents
on 127.0.0.1 (--nnodes 2, two workers each, c10d rendezvous) train so and print the groups."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from _flags import ONE_RANK, tiny_argv

from fastpar.train.checks import node_local_shard

VALUES = dict(tp=1, cp=1, dp=8, zero=1, dp_shard=None, dp_replicate=None)


@pytest.mark.parametrize(
    "env, values, shard",
    [
        (dict(WORLD_SIZE="8", LOCAL_WORLD_SIZE="4"), {}, 4),  # two nodes of 4
        (dict(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8"), dict(tp=2), 4),  # 8 GPUs = tp 2 x 4
        (dict(WORLD_SIZE="8", LOCAL_WORLD_SIZE="8"), {}, None),  # one node: full sharding
        (dict(WORLD_SIZE="8", LOCAL_WORLD_SIZE="4"), dict(zero=0), None),  # nothing sharded
        (dict(WORLD_SIZE="8", LOCAL_WORLD_SIZE="4"), dict(dp_replicate=4), None),  # given
        (dict(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8"), dict(dp=2, tp=2), None),  # node > dp
        ({}, {}, None),  # not under torchrun
    ],
)
def test_the_default_shard_group_is_one_node(monkeypatch, env, values, shard):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert node_local_shard({**VALUES, **values})["dp_shard"] == shard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_shard_inside_each_node():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    flags = tiny_argv(ONE_RANK, dp=4, zero=1, quiet=None)
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    agent += ["--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    agent += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"hsdp{port}"]
    procs = [
        subprocess.Popen(
            [*agent, "--node-rank", str(node), "-m", "fastpar.train", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    text = "\n".join(outs)
    assert [p.returncode for p in procs] == [0, 0], text[-3000:]
    # node 0's workers are ranks 0 and 1: each node's two ranks shard, the nodes replicate
    assert "world 4 = dp 4 (dp-shard 2 x dp-replicate 2)" in text, text[-3000:]
    assert "shards over dp-shard [0, 1] [2, 3], all-reduces each reduced shard over " in text
    assert "dp-replicate [0, 2] [1, 3]" in text
