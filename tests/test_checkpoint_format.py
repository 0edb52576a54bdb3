"""fastpar.checkpoint's crashes and corruption, each refused with a clear message: a
single-process save and load bit for bit (no overwrite unless asked), a truncated shard, a
flipped byte, a real SIGKILL before the completion marker, a real full disk on one rank failing
every rank, a missing file, a tensor absent, a shape mismatch, pieces that do not cover a
tensor."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastpar import checkpoint
from fastpar.checkpoint import CheckpointError
from fastpar.checkpoint import core as ckpt_core
from fastpar.checkpoint import format as ckpt_format
from fastpar.checkpoint.state import encode_runs
from fastpar.testing import RankError, run_ranks


def _tiny_checkpoint(path: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().mean().backward()
    opt.step()
    checkpoint.save(path, model_params=dict(model.named_parameters()), optimizer=opt, step=1)
    return model, opt


def _load_into_fresh(path: str, model: nn.Module | None = None) -> dict:
    model = model or nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return checkpoint.load(path, model_params=dict(model.named_parameters()), optimizer=opt)


def test_single_process_roundtrip(tmp_path):
    path = str(tmp_path / "c")
    model, opt = _tiny_checkpoint(path)
    fresh = nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    checkpoint.load(path, model_params=dict(fresh.named_parameters()), optimizer=opt2)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    s, s2 = opt.state[model.weight], opt2.state[fresh.weight]
    assert set(s) == set(s2) and all(torch.equal(s[k], s2[k]) for k in s)
    with pytest.raises(FileExistsError):
        _tiny_checkpoint(path)
    names = dict(model.named_parameters())
    checkpoint.save(path, model_params=names, optimizer=opt, step=2, overwrite=True)
    assert checkpoint.verify(path)["step"] == 2 and not os.path.exists(path + ".old")


def _saved_shard(tmp_path) -> tuple[str, str]:
    """A ``_tiny_checkpoint`` under ``tmp_path``: (its path, its rank 0's shard)."""
    path = str(tmp_path / "c")
    _tiny_checkpoint(path)
    return path, os.path.join(path, "rank00000.pt")


def test_truncated_shard_is_refused(tmp_path):
    path, shard = _saved_shard(tmp_path)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=r"rank00000\.pt has \d+ bytes.*truncated"):
        _load_into_fresh(path)


def test_corrupted_byte_is_refused(tmp_path):
    path, shard = _saved_shard(tmp_path)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"sha256 mismatch for rank00000\.pt"):
        _load_into_fresh(path)
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        checkpoint.verify(path)


def _killed_before_the_marker(path: str) -> None:
    """A save whose process dies of SIGKILL the moment it would write the completion marker."""
    ckpt_format.write_marker = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    _tiny_checkpoint(path)


def test_crash_before_the_marker_leaves_nothing_loadable(tmp_path):
    """A real crash (SIGKILL of the saving process) after every file but the marker."""
    path = str(tmp_path / "c")
    with pytest.raises(RankError, match=r"rank 0 exited \(signal 9\) without a result"):
        run_ranks(_killed_before_the_marker, 1, path)
    assert not os.path.exists(path) and os.path.exists(path + ".partial")
    assert "rank00000.pt" in os.listdir(path + ".partial")
    with pytest.raises(CheckpointError, match="did not finish"):
        _load_into_fresh(path)
    _tiny_checkpoint(path)  # the next save replaces the stale partial directory
    assert not os.path.exists(path + ".partial")
    _load_into_fresh(path)
    os.remove(os.path.join(path, "COMPLETE"))
    with pytest.raises(CheckpointError, match="no completion marker"):
        _load_into_fresh(path)


def _one_shard_too_big(path: str) -> str:
    """Rank 1 holds 1 MiB, rank 0 16 bytes: on a 256 KiB disk only rank 0's shard fits.
    Returns how this rank's save failed."""
    rank = dist.get_rank()
    w = nn.Parameter(torch.zeros(2**18 if rank == 1 else 4))
    try:
        checkpoint.save(path, model_params={f"w{rank}": w}, step=0)
    except (OSError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_full_disk_on_one_rank_fails_every_rank(small_disk):
    """A real full disk (a tmpfs, tests/_disk.py) that only rank 1's shard does not fit: rank
    1's write fails with ENOSPC naming its file, rank 0's succeeds, and rank 0 fails too (the
    save agrees on failing before anything is completed)."""
    path = os.path.join(small_disk(2**18), "c")
    assert run_ranks(_one_shard_too_big, 2, path) == [
        f"CheckpointError: another rank failed to write its shard of {path}",
        f"OSError: [Errno 28] No space left on device: '{path}.partial/rank00001.pt'",
    ]
    assert not os.path.exists(path)


def test_missing_file_uncovered_tensor_absent_name_shape_mismatch(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    _tiny_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"model tensor 'extra\.weight' is absent"):
        model = nn.Linear(3, 2)
        names = {**dict(model.named_parameters()), "extra.weight": nn.Parameter(torch.zeros(1))}
        checkpoint.load(path, model_params=names)
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'weight'"):
        _load_into_fresh(path, nn.Linear(3, 3))
    os.remove(os.path.join(path, "rank00000.pt"))
    with pytest.raises(CheckpointError, match=r"rank00000\.pt is missing"):
        _load_into_fresh(path)

    # a shard that lacks part of a tensor: drop half of the weight's pieces at save time
    real = ckpt_core._collect

    def collect(*args):
        entries, holds, tensors = real(*args)
        for e in entries:
            if e["name"] == "weight":
                e["runs"], e["values"] = encode_runs(torch.arange(3)), e["values"][:3]
        return entries, holds, tensors

    monkeypatch.setattr(ckpt_core, "_collect", collect)
    path2 = str(tmp_path / "d")
    _tiny_checkpoint(path2)
    with pytest.raises(CheckpointError, match=r"pieces of 'weight' \(model\) do not cover it"):
        _load_into_fresh(path2)
