"""fastpar.checkpoint: bit-identical resume on the same layout, resume under another layout,
crash / corruption refused with a clear message, export to one plain state_dict."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastpar import ParallelMesh, checkpoint
from fastpar.amp import DynamicLossScaler
from fastpar.checkpoint import CheckpointError
from fastpar.checkpoint import core as ckpt_core
from fastpar.checkpoint import format as ckpt_format
from fastpar.checkpoint.state import decode_runs, encode_runs, global_index
from fastpar.moe import MoE, moe_aux_loss
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.optim import MixedPrecisionOptimizer
from fastpar.parallel import DistributedDataParallel
from fastpar.testing import RankError, run_ranks
from fastpar.zero import ZeroOptimizer

STEPS, SAVE_AT = 5, 2
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, after a change of layout (other reduction orders)


# -- a data-parallel MLP: same layout, bit for bit ------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5))


def _batch(step: int, world: int, rank: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 7, generator=g), torch.randn(8, 5, generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _train_mlp(kind: str, path: str, resume: bool, noise: bool = True):
    """Train STEPS steps (saving before step SAVE_AT), or resume from ``path`` and finish.
    Returns ({step: loss}, final parameters)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ParallelMesh()
    torch.manual_seed(7 if resume else 0)  # a resumed run must get everything from the disk
    model = _mlp().half() if kind == "mp" else _mlp()
    forward = model
    if kind in ("ddp", "mp"):
        forward = DistributedDataParallel(model, mesh=mesh)
        inner = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
        opt = inner
        if kind == "mp":
            scaler = DynamicLossScaler(initial_scale=2.0**12, growth_interval=2)
            opt = MixedPrecisionOptimizer(inner, scaler=scaler, mesh=mesh)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
        stage = 2 if kind.startswith("zero2") else 1
        opt = ZeroOptimizer(inner, stage=stage, mesh=mesh, bucket_size_mb=2e-4)
    names = dict(model.named_parameters())
    start = 0
    if resume:
        info = checkpoint.load(path, model_params=names, optimizer=opt, mesh=mesh)
        start = info["extra"]["next_step"]
        assert info["step"] == start and info["rng_restored"] == (kind != "zero2-to-zero1")
    else:
        torch.manual_seed(100 + rank)  # per-rank noise: RNG states must come back on resume
    losses = {}
    for step in range(start, STEPS):
        if step == SAVE_AT and not resume:
            checkpoint.save(
                path, model_params=names, optimizer=opt, mesh=mesh, step=step,
                extra={"next_step": step},
            )  # fmt: skip
        x, y = _batch(step, world, rank)
        if noise:
            x = x + 0.01 * torch.randn_like(x)
        if kind == "mp":
            loss = F.mse_loss(forward(x.half()).float(), y)
        else:
            loss = F.mse_loss(forward(x), y)
        if kind == "ddp":
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            opt.zero_grad()
            opt.scale_loss(loss).backward()
            opt.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses[step] = float(total / world)
    return losses, [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "mp"])
def test_resume_is_bit_identical(kind, tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(_train_mlp, 2, kind, path, False)
    assert os.path.exists(os.path.join(path, "COMPLETE"))
    resumed = run_ranks(_train_mlp, 2, kind, path, True)
    for (losses, params), (losses_r, params_r) in zip(full, resumed, strict=True):
        assert list(losses_r) == list(range(SAVE_AT, STEPS))
        assert [losses[s] for s in losses_r] == list(losses_r.values())  # bit for bit
        for p, q in zip(params, params_r, strict=True):
            assert torch.equal(p, q)


def test_zero2_dp4_resumes_as_zero1_dp2(tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(_train_mlp, 4, "zero2", path, False, noise=False)
    resumed = run_ranks(_train_mlp, 2, "zero2-to-zero1", path, True, noise=False)
    ref_losses, ref_params = full[0]
    losses, params = resumed[0]
    torch.testing.assert_close(
        torch.tensor(list(losses.values())),
        torch.tensor([ref_losses[s] for s in losses]),
        **TOL,
    )
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, **TOL)


# -- tensor parallel: fused q|k|v, a padded vocabulary --------------------------------------
VOCAB, H = 11, 8  # 11 rows over TP=2: 6 per rank, one padding row


class _TPNet(nn.Module):
    def __init__(self, mesh=None) -> None:
        super().__init__()
        self.emb = VocabParallelEmbedding(VOCAB, H, mesh=mesh)
        self.qkv = ColumnParallelLinear(H, 3 * H, fused=3, mesh=mesh)
        self.proj = RowParallelLinear(H, H, mesh=mesh)
        self.norm = nn.LayerNorm(H)
        self.head = ColumnParallelLinear(H, VOCAB, pad_output=True, gather_output=True, mesh=mesh)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.head(self.norm(x + self.proj(torch.tanh(q) * k + v)))


class _PlainNet(nn.Module):
    """_TPNet in plain torch.nn, with the same parameter names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.qkv = nn.Linear(H, 3 * H)
        self.proj = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, VOCAB)

    forward = _TPNet.forward


def _tokens(step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (4, 5), generator=g)
    return ids, torch.randint(0, VOCAB, (4, 5), generator=g)


def _tp_step(model, opt, ids, tgt) -> float:
    loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _train_tp(path: str):
    """TP = 2 × DP = 2, torch AdamW (DDP over the dp group); saves before step SAVE_AT."""
    mesh = ParallelMesh(tp=2)
    torch.manual_seed(0)
    model = _TPNet(mesh)
    ddp = DistributedDataParallel(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    names = dict(model.named_parameters())
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            checkpoint.save(path, model_params=names, optimizer=opt, mesh=mesh, step=step)
        ids, tgt = _tokens(step)
        loss = _tp_step(ddp, opt, ids.chunk(2)[mesh.dp_rank], tgt.chunk(2)[mesh.dp_rank])
        dist.all_reduce(loss, group=mesh.dp_group)
        losses.append(float(loss / 2))
    return losses


def _resume_single(model: nn.Module, path: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    info = checkpoint.load(path, model_params=dict(model.named_parameters()), optimizer=opt)
    assert not info["rng_restored"]  # another layout
    return [float(_tp_step(model, opt, *_tokens(s))) for s in range(info["step"], STEPS)]


def test_tp2_dp2_resumes_as_one_process_and_exports(tmp_path):
    path = str(tmp_path / "ckpt")
    ref = run_ranks(_train_tp, 4, path)[0]
    torch.manual_seed(3)
    losses = _resume_single(_TPNet(), path)  # TP = 1, no process group
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[SAVE_AT:]), **TOL)

    # export: equals the single-process model trained the same way, loads into plain torch
    out = str(tmp_path / "model.pt")
    exported = checkpoint.export_state_dict(path, out)
    torch.manual_seed(0)
    single = _PlainNet()
    opt = torch.optim.AdamW(single.parameters(), lr=0.02, weight_decay=0.01)
    for s in range(SAVE_AT):
        _tp_step(single, opt, *_tokens(s))
    plain = _PlainNet()
    plain.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert set(exported) == set(single.state_dict())
    for name, t in single.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], t, **TOL, msg=name)

    # import the exported file into a TP = 1 fastpar model: same tensors
    model = _TPNet()
    checkpoint.import_state_dict(out, dict(model.named_parameters()))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), exported[name]), name


# -- mixture of experts: EP = 2 -> EP = 1 ---------------------------------------------------
class _MoENet(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.moe = MoE(H, 16, 4, top_k=2, capacity_factor=None, mesh=mesh, aux_loss_coef=0.05)
        self.head = nn.Linear(H, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(x + self.moe(x))


def _train_moe(ep: int, path: str, resume: bool):
    rank = dist.get_rank()
    mesh = ParallelMesh(ep=ep)  # world 2: dp = 2
    torch.manual_seed(5 if resume else 0)
    model = _MoENet(mesh)
    # ZeRO-1 shards experts over the expert-DP group (1 rank at EP = 2, 2 at EP = 1)
    inner = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    opt = ZeroOptimizer(inner, stage=1, mesh=mesh, bucket_size_mb=1e-3)
    names = dict(model.named_parameters())
    start = 0
    if resume:
        start = checkpoint.load(path, model_params=names, optimizer=opt, mesh=mesh)["step"]
    losses = {}
    for step in range(start, STEPS):
        if step == SAVE_AT and not resume:
            checkpoint.save(path, model_params=names, optimizer=opt, mesh=mesh, step=step)
        ids, tgt = _tokens(step)
        ids, tgt = ids.chunk(2)[rank], tgt.chunk(2)[rank]
        loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()) + moe_aux_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = float(total / 2)
    return losses


def test_moe_ep2_resumes_as_ep1(tmp_path):
    path = str(tmp_path / "ckpt")
    ref = run_ranks(_train_moe, 2, 2, path, False)[0]
    meta = checkpoint.verify(path)
    assert meta["tensors"]["moe.w1"]["shape"] == [4, H, 16]  # all experts, global
    losses = run_ranks(_train_moe, 2, 1, path, True)[0]
    torch.testing.assert_close(
        torch.tensor(list(losses.values())), torch.tensor([ref[s] for s in losses]), **TOL
    )


# -- index maps -----------------------------------------------------------------------------
def test_runs_roundtrip_and_padding_rows_are_dropped():
    idx = torch.tensor([3, 4, 5, 9, 10, 0, 1])
    assert torch.equal(decode_runs(encode_runs(idx)), idx)

    def local_maps():
        emb = VocabParallelEmbedding(VOCAB, 2)
        col = ColumnParallelLinear(2, 6, fused=3)
        return global_index(emb.weight), global_index(col.weight)

    (emb0, col0), (emb1, col1) = run_ranks(local_maps, 2)
    assert emb0.flatten().tolist() == list(range(12))
    assert emb1.flatten().tolist() == [*range(12, 22), -1, -1]  # row 11 is padding
    # fused q|k|v of 2 rows each: rank 0 holds rows 0, 2, 4 of the global 6, rank 1 rows 1, 3, 5
    assert col0[:, 0].tolist() == [0, 4, 8] and col1[:, 0].tolist() == [2, 6, 10]


def test_stage_param_names():
    stage = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 3))
    names = checkpoint.stage_param_names(stage, 4)
    assert list(names) == ["4.weight", "4.bias", "6.weight", "6.bias"]


# -- crashes and corruption -----------------------------------------------------------------
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


def test_truncated_shard_is_refused(tmp_path):
    path = str(tmp_path / "c")
    _tiny_checkpoint(path)
    shard = os.path.join(path, "rank00000.pt")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=r"rank00000\.pt has \d+ bytes.*truncated"):
        _load_into_fresh(path)


def test_corrupted_byte_is_refused(tmp_path):
    path = str(tmp_path / "c")
    _tiny_checkpoint(path)
    shard = os.path.join(path, "rank00000.pt")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"sha256 mismatch for rank00000\.pt"):
        _load_into_fresh(path)
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        checkpoint.verify(path)


def test_crash_before_the_marker_leaves_nothing_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / "c")

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(ckpt_format, "write_marker", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _tiny_checkpoint(path)
    assert not os.path.exists(path) and os.path.exists(path + ".partial")
    with pytest.raises(CheckpointError, match="did not finish"):
        _load_into_fresh(path)
    monkeypatch.undo()
    _tiny_checkpoint(path)  # the next save replaces the stale partial directory
    assert not os.path.exists(path + ".partial")
    _load_into_fresh(path)
    os.remove(os.path.join(path, "COMPLETE"))
    with pytest.raises(CheckpointError, match="no completion marker"):
        _load_into_fresh(path)


def test_crash_on_one_rank_fails_every_rank(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    real = ckpt_core._collect

    def collect(*args):
        if dist.get_rank() == 1:
            raise OSError("disk full")
        return real(*args)

    monkeypatch.setattr(ckpt_core, "_collect", collect)

    def run():
        model = nn.Linear(3, 2)
        checkpoint.save(path, model_params=dict(model.named_parameters()), step=0)

    with pytest.raises(RankError, match=r"disk full|another rank failed"):
        run_ranks(run, 2)
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


# -- a tied copy is one global tensor -----------------------------------------------------------
def test_a_marked_tied_copy_is_saved_and_loaded_as_the_tensor_it_copies(tmp_path):
    """A pipeline's last stage lists its copy of the tied embedding under its own name
    ("5.weight", "lm_head.weight"); the checkpoint holds it once, as the embedding."""
    torch.manual_seed(0)
    embed = nn.Parameter(torch.randn(5, 3))
    path = str(tmp_path / "c")
    checkpoint.save(path, model_params={"0.tok.weight": embed}, step=1)  # pp = 1
    copy = nn.Parameter(torch.zeros(5, 3))
    checkpoint.mark_tied_copy(copy, "0.tok.weight")
    checkpoint.load(path, model_params={"5.weight": copy})  # the last stage at pp = 2
    assert torch.equal(copy, embed)
    again = str(tmp_path / "d")
    checkpoint.save(again, model_params={"5.weight": copy}, step=1)
    assert list(checkpoint.verify(again)["tensors"]) == ["0.tok.weight"]
    fresh = nn.Parameter(torch.zeros(5, 3))
    checkpoint.mark_tied_copy(fresh, "0.tok.weight")
    checkpoint.import_state_dict(checkpoint.export_state_dict(again), {"lm_head.weight": fresh})
    assert torch.equal(fresh, embed)
