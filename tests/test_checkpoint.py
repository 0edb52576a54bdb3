"""fastpar.checkpoint: bit-identical resume on the same layout, resume under another layout,
export to one plain state_dict, a tied copy saved once (crashes and corruption:
tests/test_checkpoint_format.py).

A resume on the same layout repeats the same kernels on the same values: bit for bit. Under
another layout (other reduction orders) it is not; there every run — the one that saved and the
one that resumed — is judged by ``fastpar.tolerance``'s rule against the single-process training
of the same math (``train_references``: fp32, its twin and float64, AdamW's slack included).
Loading, exporting and importing copy tensors: bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from torch import nn

from fastpar import checkpoint
from fastpar.amp import DynamicLossScaler
from fastpar.checkpoint.state import decode_runs, encode_runs, global_index
from fastpar.moe import MoE, moe_aux_loss
from fastpar.moe.layer import aux_loss_scale
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.optim import MixedPrecisionOptimizer
from fastpar.parallel import DistributedDataParallel
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import References, train_references
from fastpar.zero import ZeroOptimizer

STEPS, SAVE_AT = 5, 2
ADAMW = dict(lr=0.02, weight_decay=0.01)  # every run's AdamW (torch's defaults otherwise)


def _agree_all(refs: References, losses: dict, params: dict | None = None, what: str = "") -> None:
    """Each step's loss of ``losses`` ({step: loss}) and each of ``params`` ({name: tensor})
    against the single-process references (``fastpar.tolerance``'s rule)."""
    for c in [refs.loss(step, loss) for step, loss in losses.items()] + [
        refs.param(name, t) for name, t in (params or {}).items()
    ]:
        if not c.ok:
            raise AssertionError(f"{what}: {c}")


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
    mesh = make_mesh()
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
                path,
                model_params=names,
                optimizer=opt,
                mesh=mesh,
                step=step,
                extra={"next_step": step},
            )
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
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "mp"])
def test_resume_is_bit_identical(kind, tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(_train_mlp, 2, kind, path, False)
    assert os.path.exists(os.path.join(path, "COMPLETE"))
    resumed = run_ranks(_train_mlp, 2, kind, path, True)
    for (losses, params), (losses_r, params_r) in zip(full, resumed, strict=True):
        assert list(losses_r) == list(range(SAVE_AT, STEPS))
        assert [losses[s] for s in losses_r] == list(losses_r.values())  # bit for bit
        assert list(params) == list(params_r)
        for name, p in params.items():  # bit for bit: the same kernels on the same values
            assert torch.equal(p, params_r[name]), name


def _mlp_references() -> References:
    """The MLP's single-process training on each step's whole batch (the DP replicas' mean)."""

    def loss(model, step, dtype):
        x, y = _batch(step, 1, 0)
        return F.mse_loss(model(x.to(dtype)), y.to(dtype))

    length = reduction_length(_mlp(), _batch(0, 1, 0))
    return train_references(_mlp, loss, STEPS, length=length, **ADAMW)


def test_zero2_dp4_resumes_as_zero1_dp2(tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(_train_mlp, 4, "zero2", path, False, noise=False)
    resumed = run_ranks(_train_mlp, 2, "zero2-to-zero1", path, True, noise=False)
    refs = _mlp_references()
    for rank, (losses, params) in enumerate(full):
        _agree_all(refs, losses, params, f"ZeRO-2 at dp 4, rank {rank}")
    for rank, (losses, params) in enumerate(resumed):
        assert list(losses) == list(range(SAVE_AT, STEPS))
        _agree_all(refs, losses, params, f"resumed as ZeRO-1 at dp 2, rank {rank}")


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
    mesh = make_mesh(tp=2)
    torch.manual_seed(0)
    model = _TPNet(mesh)
    ddp = DistributedDataParallel(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
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


def _resume_single(model: nn.Module, path: str) -> dict[int, float]:
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    info = checkpoint.load(path, model_params=dict(model.named_parameters()), optimizer=opt)
    assert not info["rng_restored"]  # another layout
    return {s: float(_tp_step(model, opt, *_tokens(s))) for s in range(info["step"], STEPS)}


def _tp_references(steps: int) -> References:
    """_PlainNet's single-process training, ``steps`` steps on each step's whole batch."""

    def loss(model, step, dtype):
        ids, tgt = _tokens(step)
        return F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())

    length = reduction_length(_PlainNet(), _tokens(0))
    return train_references(_PlainNet, loss, steps, length=length, **ADAMW)


def test_tp2_dp2_resumes_as_one_process_and_exports(tmp_path):
    path = str(tmp_path / "ckpt")
    ref = run_ranks(_train_tp, 4, path)[0]
    refs = _tp_references(STEPS)
    _agree_all(refs, dict(enumerate(ref)), what="TP 2 x DP 2")
    torch.manual_seed(3)
    losses = _resume_single(_TPNet(), path)  # TP = 1, no process group
    assert list(losses) == list(range(SAVE_AT, STEPS))
    _agree_all(refs, losses, what="resumed at TP 1")

    # export: equals the single-process model trained the same way, loads into plain torch
    out = str(tmp_path / "model.pt")
    exported = checkpoint.export_state_dict(path, out)
    at_save = _tp_references(SAVE_AT)
    plain = _PlainNet()
    plain.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert set(exported) == set(at_save.single.params) == set(plain.state_dict())
    _agree_all(at_save, {}, plain.state_dict(), f"exported after {SAVE_AT} steps")

    # import the exported file into a TP = 1 fastpar model: same tensors
    model = _TPNet()
    checkpoint.import_state_dict(out, dict(model.named_parameters()))
    for name, p in model.named_parameters():  # bit for bit: a copy
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
    mesh = make_mesh(ep=ep, dp=2)
    torch.manual_seed(5 if resume else 0)
    model = _MoENet(mesh)
    # ZeRO-1 shards experts over the expert-DP group (1 rank at EP = 2, 2 at EP = 1)
    inner = torch.optim.AdamW(model.parameters(), **ADAMW)
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


def _moe_references() -> References:
    """_MoENet's single-process training: per step the mean over the two DP replicas' halves of
    the batch of (cross-entropy + their own aux loss), the aux loss sent to backward with the
    same weight 1/2 (``aux_loss_scale``)."""

    def loss(model, step, dtype):
        ids, tgt = _tokens(step)
        total = 0.0
        for r in range(2):
            with aux_loss_scale(0.5):
                logits = model(ids.chunk(2)[r])
            ce = F.cross_entropy(logits.flatten(0, 1), tgt.chunk(2)[r].flatten())
            total = total + (ce + moe_aux_loss(model)) / 2  # the aux value: in backward already
        return total

    length = reduction_length(_MoENet(None), _tokens(0))
    return train_references(lambda: _MoENet(None), loss, STEPS, length=length, **ADAMW)


def test_moe_ep2_resumes_as_ep1(tmp_path):
    path = str(tmp_path / "ckpt")
    ref = run_ranks(_train_moe, 2, 2, path, False)[0]
    meta = checkpoint.verify(path)
    assert meta["tensors"]["moe.w1"]["shape"] == [4, H, 16]  # all experts, global
    losses = run_ranks(_train_moe, 2, 1, path, True)[0]
    assert list(losses) == list(range(SAVE_AT, STEPS))
    refs = _moe_references()
    _agree_all(refs, ref, what="EP 2")
    _agree_all(refs, losses, what="resumed at EP 1")


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
