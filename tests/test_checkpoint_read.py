"""Sliced loading: each rank reads about its own bytes of a checkpoint (TP=4 -> TP=4, TP=2 ->
TP=4), and every byte it uses is checked (a record's CRC-32, or a whole file's sha256).

Every comparison is bit for bit: a load copies the saved values (and the expected tensors are
slices of the same checkpoint's export); nothing here is computed two ways."""

from __future__ import annotations

import os
import zipfile

import pytest
import torch
from _mesh import make_mesh
from torch import nn

from fastpar import checkpoint
from fastpar.checkpoint import CheckpointError, CheckpointReader
from fastpar.checkpoint import spans as ckpt_spans
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.testing import run_ranks

V, H = 128, 128


class _Net(nn.Module):
    def __init__(self, mesh=None) -> None:
        super().__init__()
        self.emb = VocabParallelEmbedding(V, H, mesh=mesh)
        self.qkv = ColumnParallelLinear(H, 3 * H, fused=3, mesh=mesh)
        self.proj = RowParallelLinear(H, H, mesh=mesh)
        self.norm = nn.LayerNorm(H)


def _save(tp: int, path: str, piece_bytes: int) -> None:
    ckpt_spans.PIECE_BYTES = piece_bytes  # in the rank process
    mesh = make_mesh(tp=tp)
    torch.manual_seed(0)
    model = _Net(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    checkpoint.save(
        path, model_params=dict(model.named_parameters()), optimizer=opt, mesh=mesh, step=1
    )


def _load(tp: int, path: str):
    mesh = make_mesh(tp=tp)
    torch.manual_seed(1)
    model = _Net(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    reader = CheckpointReader(path)
    checkpoint.load(reader, model_params=dict(model.named_parameters()), optimizer=opt, mesh=mesh)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return reader.bytes_read, dict(reader.file_bytes), state


def _reference(path: str, tp: int) -> list[dict]:
    """Each TP rank's expected tensors, sliced from the single-process export by hand."""
    full = checkpoint.export_state_dict(path)
    out = []
    for r in range(tp):
        q, k, v = full["qkv.weight"].chunk(3)
        qb, kb, vb = full["qkv.bias"].chunk(3)
        out.append(
            {
                "emb.weight": full["emb.weight"].chunk(tp)[r],
                "qkv.weight": torch.cat([t.chunk(tp)[r] for t in (q, k, v)]),
                "qkv.bias": torch.cat([t.chunk(tp)[r] for t in (qb, kb, vb)]),
                "proj.weight": full["proj.weight"].chunk(tp, dim=1)[r],
                "proj.bias": full["proj.bias"],
                "norm.weight": full["norm.weight"],
                "norm.bias": full["norm.bias"],
            }
        )
    return out


def _sizes(path: str) -> list[int]:
    n = len([f for f in os.listdir(path) if f.startswith("rank") and f.endswith(".pt")])
    return [os.path.getsize(os.path.join(path, f"rank{r:05d}.pt")) for r in range(n)]


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp4") / "ckpt")
    run_ranks(_save, 4, 4, path, ckpt_spans.PIECE_BYTES)
    return path


def test_tp4_reload_reads_about_its_own_file(tp4):
    sizes = _sizes(tp4)
    results = run_ranks(_load, 4, 4, tp4)
    for r, ((read, per_file, state), want) in enumerate(
        zip(results, _reference(tp4, 4), strict=True)
    ):
        for name, t in want.items():  # bit for bit: loaded copies
            assert torch.equal(state[name], t), (r, name)
        # own file at most once; the rest is the replicated norm / proj.bias (in rank 0's
        # file) and the index of each other file holding a tensor it loads (its save id)
        assert per_file[f"rank{r:05d}.pt"] <= sizes[r]
        assert read <= 1.5 * sizes[r], (r, read, sizes[r])
        assert read < 0.5 * sum(sizes)  # the old loader read every file whole


def test_tp2_to_tp4_reads_about_its_share(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, 2, path, 4096)  # records of 4 KiB: the unit of a partial read
    sizes = _sizes(path)
    share = sum(sizes) / 4  # what each of 4 ranks holds of the checkpoint
    results = run_ranks(_load, 4, 4, path)
    for r, ((read, _, state), want) in enumerate(zip(results, _reference(path, 4), strict=True)):
        for name, t in want.items():  # bit for bit: loaded copies, resharded
            assert torch.equal(state[name], t), (r, name)
        # its quarter is half of one TP=2 file: its records (+ the file indexes)
        assert read <= 1.6 * share, (r, read, share)


def _meta_tensors(path: str) -> dict:
    raw = torch.load(path, map_location="meta", weights_only=True)
    return {(p["name"], p["key"]): p["values"] for p in raw["pieces"]}


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_partial_read_checks_the_records_it_reads(tp4, tmp_path):
    import shutil

    path = str(tmp_path / "c")
    shutil.copytree(tp4, path)
    shard = os.path.join(path, "rank00000.pt")
    rows = torch.arange(2 * H)  # emb rows 0 and 1: in rank 0's shard
    reader = CheckpointReader(path)
    got = reader.gather({("emb.weight", "model"): rows})[("emb.weight", "model")]
    assert 0 < reader.bytes_read < 0.5 * os.path.getsize(shard)  # in part
    reader.release()
    full = checkpoint.export_state_dict(tp4)
    assert torch.equal(got, full["emb.weight"][:2].reshape(-1))

    pieces = _meta_tensors(shard)
    unread = pieces["norm.weight", "exp_avg"].untyped_storage()._checkpoint_offset
    _flip(shard, unread)  # a byte this gather does not use: not seen
    reader = CheckpointReader(path)
    reader.gather({("emb.weight", "model"): rows})
    reader.release()
    with pytest.raises(CheckpointError, match=r"sha256 mismatch for rank00000\.pt"):
        checkpoint.verify(path)  # verify reads everything

    used = pieces["emb.weight", "model"].untyped_storage()._checkpoint_offset + 5
    _flip(shard, used)
    reader = CheckpointReader(path)
    with pytest.raises(CheckpointError, match=r"rank00000\.pt.*corrupted"):
        reader.gather({("emb.weight", "model"): rows})
    reader.release()


def test_a_file_without_crcs_is_read_whole_and_its_sha256_checked(tmp_path):
    path = str(tmp_path / "c")
    torch.serialization.set_crc32_options(False)
    try:
        model = nn.Linear(64, 64)
        checkpoint.save(path, model_params=dict(model.named_parameters()), step=0)
    finally:
        torch.serialization.set_crc32_options(True)
    shard = os.path.join(path, "rank00000.pt")
    assert all(i.CRC == 0 for i in zipfile.ZipFile(shard).infolist())
    reader = CheckpointReader(path)
    reader.gather({("weight", "model"): torch.arange(3)})
    assert reader.file_bytes["rank00000.pt"] >= os.path.getsize(shard)  # whole
    reader.release()
    offset = _meta_tensors(shard)["weight", "model"].untyped_storage()._checkpoint_offset
    _flip(shard, offset + 100)
    reader = CheckpointReader(path)
    with pytest.raises(CheckpointError, match=r"sha256 mismatch for rank00000\.pt"):
        reader.gather({("weight", "model"): torch.arange(3)})
    reader.release()


def test_spans_compress_and_split_round_trip():
    from fastpar.checkpoint.state import decode_runs, encode_runs

    idx = torch.tensor([5, 6, 7, 8, 20, 21, 22, 40, 41, 42, 43, 44, 45, 100])
    runs, vals = encode_runs(idx), torch.arange(idx.numel()).float()
    for max_bytes in (4, 12, 20, 4096):
        parts = ckpt_spans.split(runs, vals, max_bytes)
        assert torch.equal(torch.cat([decode_runs(r) for r, _ in parts]), idx)
        assert torch.equal(torch.cat([v for _, v in parts]), vals)
        assert all(v.numel() <= max(1, max_bytes // 4) for _, v in parts)
        for r, _ in parts:
            assert torch.equal(ckpt_spans.expand(ckpt_spans.compress(r)), r)
    rows = torch.stack([torch.arange(0, 800, 100), torch.full((8,), 10)], 1)  # a column shard
    assert ckpt_spans.compress(rows) == [[0, 10, 8, 100]]
