"""Bridges to torch's own parallelism: ParallelMesh <-> DeviceMesh with the very same process
groups, layers that take a DeviceMesh as mesh=, and the global grad norm under FSDP2
(fully_shard) over fastpar's TP layers, against the single-process norm — where torch's own
clip_grad_norm_ gives a per-TP-rank norm.

Norms and gradients of the sharded model are sums in another order than the single process's,
so they are judged by ``fastpar.tolerance``'s rule against the same math in float64 (the dense
model ``.double()``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import agree, exact_copy, local_slice
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fastpar import ParallelMesh
from fastpar.amp import clip_grad_norm_, global_grad_norm
from fastpar.mesh import restore_marks
from fastpar.nn import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)
from fastpar.nn.marks import mark_replicated, param_layout
from fastpar.testing import run_ranks


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _device_mesh_round_trip() -> None:
    me = dist.get_rank()
    # TP2 x DP2, Megatron's order tp-ep-dp-pp: tp fastest, so the DeviceMesh is (pp, dp, tp)
    mesh = ParallelMesh(tp=2)
    dm = mesh.to_device_mesh()
    assert dm.mesh_dim_names == ("pp", "dp", "tp")
    assert dm.mesh.tolist() == [[[0, 1], [2, 3]]]
    for name in ("pp", "dp", "tp"):
        assert dm[name].get_group() is mesh.group(name), name  # the very same group objects
    assert _ranks(dm["tp"].get_group()) == [me - me % 2, me - me % 2 + 1]
    back = ParallelMesh.from_device_mesh(dm)
    assert back.layout.order == mesh.layout.order
    for kind in ("tp", "dp", "pp", "mp", "tp-dp", "embedding", "ep", "expert-dp", "tp-ep"):
        assert back.ranks(kind) == mesh.ranks(kind), kind
    for kind in ("tp", "dp", "pp"):
        assert back.group(kind) is mesh.group(kind), kind

    # a DeviceMesh built torchtitan style, in either dim order
    for names, tp_ranks in ((("dp", "tp"), [[0, 1], [2, 3]]), (("tp", "dp"), [[0, 2], [1, 3]])):
        user = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        got = ParallelMesh.from_device_mesh(user)
        assert got.tp_group is user.get_group("tp") and got.dp_group is user.get_group("dp")
        assert got.ranks("tp") == next(g for g in tp_ranks if me in g), names
        assert (got.tp_size, got.dp_size, got.pp_size) == (2, 2, 1)
        layer = ColumnParallelLinear(4, 6, mesh=user)  # a DeviceMesh as mesh=: its "tp" dim
        assert layer.group is user.get_group("tp")
        assert VocabParallelCrossEntropy(mesh=user).group is user.get_group("tp")

    # expert parallelism: the expert grid refines dp into edp x ep
    moe_mesh = ParallelMesh(tp=2, ep=2)
    dm = moe_mesh.to_device_mesh()
    assert dm.mesh_dim_names == ("pp", "edp", "ep", "tp") and tuple(dm.shape) == (1, 1, 2, 2)
    assert dm["ep"].get_group() is moe_mesh.ep_group
    assert dm["edp"].get_group() is moe_mesh.expert_dp_group
    dense = moe_mesh.to_device_mesh(dense=True)
    assert (
        dense.mesh_dim_names == ("pp", "dp", "tp") and dense["dp"].get_group() is moe_mesh.dp_group
    )
    back = ParallelMesh.from_device_mesh(dm)
    assert (back.ep_size, back.dp_size) == (2, 2)
    assert back.ranks("dp") == moe_mesh.ranks("dp") and back.ep_group is moe_mesh.ep_group
    from fastpar.moe import MoE

    assert MoE(4, 8, 4, mesh=dm).ep_group is moe_mesh.ep_group  # a DeviceMesh's "ep" dim

    # context parallelism: a "cp" dim round-trips (its groups are the mesh's)
    cp_dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp_mesh = ParallelMesh.from_device_mesh(cp_dm)
    assert (cp_mesh.cp_size, cp_mesh.tp_size, cp_mesh.dp_size) == (2, 2, 1)
    assert cp_mesh.cp_group is cp_dm.get_group("cp") and cp_mesh.ranks("cp") == [
        r for r in range(4) if r % 2 == dist.get_rank() % 2
    ]
    assert cp_mesh.to_device_mesh().mesh_dim_names == ("pp", "dp", "cp", "tp")
    # clear errors, naming the fix
    with pytest.raises(ValueError, match="no fastpar counterpart"):
        ParallelMesh.from_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp")))
    no_tp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="no 'tp' dim"):
        ColumnParallelLinear(4, 6, mesh=no_tp)
    with pytest.raises(TypeError, match="ParallelMesh or a torch DeviceMesh"):
        RowParallelLinear(4, 6, mesh=object())


def test_device_mesh_round_trip_same_groups():
    run_ranks(_device_mesh_round_trip, 4, timeout=120)


class _Net(nn.Module):
    """Embedding (vocabulary 11: padded at TP2) -> LayerNorm -> column -> GELU -> row -> LM
    head (column, padded, gathered)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(self.down(F.gelu(self.up(self.ln(self.emb(ids))))))


def _tp(dense: _Net, mesh: ParallelMesh) -> _Net:
    net = copy.deepcopy(dense)
    net.emb = VocabParallelEmbedding.from_dense(dense.emb, mesh=mesh)
    net.up = ColumnParallelLinear.from_dense(dense.up, mesh=mesh)
    net.down = RowParallelLinear.from_dense(dense.down, mesh=mesh)
    net.head = ColumnParallelLinear.from_dense(
        dense.head, gather_output=True, pad_output=True, mesh=mesh
    )
    return net


def _batch(dp_rank: int, dp: int):
    g = torch.Generator().manual_seed(7)
    ids, tgt = (torch.randint(0, 11, (4 * dp, 5), generator=g) for _ in range(2))
    return ids.chunk(dp)[dp_rank], tgt.chunk(dp)[dp_rank], ids, tgt


def _loss(net, ids, tgt):
    return F.cross_entropy(net(ids).flatten(0, 1), tgt.flatten())


def _fsdp2_clip() -> dict:
    mesh = ParallelMesh(tp=2)  # TP2 x DP2
    torch.manual_seed(0)
    dense = _Net()
    for p in dense.parameters():
        p.data.normal_(0, 0.5)
    dense64 = exact_copy(dense)  # the exact math of the single-process model
    net = _tp(dense, mesh)
    before = dict(net.named_parameters())
    fsdp = fully_shard(net, mesh=mesh.to_device_mesh()["dp"])
    fsdp.set_force_sum_reduction_for_comms(True)  # gloo's AVG reduce-scatter is wrong
    ids, tgt, all_ids, all_tgt = _batch(mesh.dp_rank, mesh.dp_size)
    _loss(net, ids, tgt).backward()
    _loss(dense, all_ids, all_tgt).backward()  # the single-process model on the global batch
    _loss(dense64, all_ids, all_tgt).backward()
    params = dict(net.named_parameters())
    n_grad = all_ids.numel()  # a weight gradient sums over the tokens
    n_norm = max(n_grad, sum(p.numel() for p in dense.parameters()))  # a norm over every element
    assert all(isinstance(p.grad, DTensor) for p in params.values())

    def local_grad(name):  # this TP rank's gradient: the DTensor over dp, gathered
        return params[name].grad.full_tensor()

    dense_grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
    dense_grads64 = {n: p.grad.clone() for n, p in dense64.named_parameters()}

    def expected(name, grads):  # this TP rank's part of the dense gradient
        g = grads[name]
        return g if param_layout(before[name]) is None else local_slice(g, before[name])

    def total(grads):
        return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))

    true, true64 = total(dense_grads), total(dense_grads64)

    # torch's own clip: the norm of this TP rank's shards (replicated parameters whole)
    def per_tp_rank(grads):
        return torch.stack([expected(n, grads).norm() for n in params]).norm()

    torch_norm = torch.nn.utils.get_total_norm([p.grad for p in params.values()])
    torch_norm = torch_norm.full_tensor() if isinstance(torch_norm, DTensor) else torch_norm
    agree(
        torch_norm,
        per_tp_rank(dense_grads),
        per_tp_rank(dense_grads64),
        "torch's norm: per TP rank",
        length=n_norm,
    )
    assert abs(float(torch_norm) - float(true)) > 1e-3 * float(true), "torch's norm is right?"

    # marks lost by fully_shard: refused, naming the fix
    with pytest.raises(ValueError, match="restore_marks"):
        global_grad_norm(params.values(), mesh=mesh)
    assert restore_marks(before, net) == 7  # every parameter but the LayerNorm's two

    max_norm = float(true) / 3
    for ref in (dense, dense64):  # the reference clipping, in fp32 and in float64
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    clipped = {n: p.grad for n, p in dense.named_parameters()}
    clipped64 = {n: p.grad for n, p in dense64.named_parameters()}
    norm = clip_grad_norm_(params.values(), max_norm, mesh=mesh)
    assert not isinstance(norm, DTensor)
    agree(norm, true, true64, "fastpar's norm under FSDP2 + TP", length=n_norm)
    for name in params:
        # the clip scales by max_norm / norm: the norm's sum feeds every element
        agree(
            local_grad(name),
            expected(name, clipped),
            expected(name, clipped64),
            f"clipped grad of {name}",
            length=n_norm,
        )

    # torch's own TP (a DTensor spanning tp, replicated over dp): counted by its placements
    full = torch.arange(12.0).reshape(4, 3)
    dp_tp, placements = mesh.to_device_mesh()["dp", "tp"], [Replicate(), Shard(0)]
    q = nn.Parameter(DTensor.from_local(torch.zeros(2, 3), dp_tp, placements))
    q.grad = DTensor.from_local(full.chunk(2)[mesh.tp_rank].clone(), dp_tp, placements)
    agree(
        global_grad_norm([q], mesh=mesh),
        full.norm(),
        full.double().norm(),
        "torch TP DTensor norm",
        length=full.numel(),
    )

    # a Partial (unreduced) DTensor gradient is refused
    p = nn.Parameter(torch.zeros(3))
    p.grad = DTensor.from_local(torch.ones(3), mesh.to_device_mesh()["dp"], [Partial()])
    mark_replicated(p, mesh.tp_group)
    with pytest.raises(ValueError, match="Partial"):
        global_grad_norm([p], mesh=mesh)
    return {"torch": float(torch_norm), "fastpar": float(norm), "true": float(true)}


def test_clip_grad_norm_under_fsdp2_and_tp_matches_single_process():
    out = run_ranks(_fsdp2_clip, 4, timeout=120)
    # one norm on every rank, bit for bit: the square root of the same all-reduced sum
    assert len({o["fastpar"] for o in out}) == 1
