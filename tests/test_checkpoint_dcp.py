"""torch.distributed.checkpoint through fastpar.checkpoint.dcp: a DTensor state dict from the
marks saves the true global tensors (unpadded, q|k|v unfused) and reloads under other layouts;
raw DCP on plain shards is the trap the check refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _parity import local_slice
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fastpar import ParallelMesh
from fastpar.checkpoint import (
    check_dcp_state_dict,
    from_dtensor_state_dict,
    to_dtensor_state_dict,
)
from fastpar.checkpoint import dcp as fp_dcp
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.nn.marks import expert_layout, mark_expert, param_layout
from fastpar.testing import run_ranks

VOCAB, HIDDEN, EXPERTS = 11, 8, 4  # 11 rows: padded at TP 2 (6 + 5) and TP 4 (3, 3, 3, 2)


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 layout (weight [in, out]); fastpar keeps it (sharded along dim 1)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.empty(nf))


def _dense(seed: int) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    mods = {
        "emb": nn.Embedding(VOCAB, HIDDEN),
        "qkv": nn.Linear(HIDDEN, 3 * HIDDEN),  # fused q|k|v
        "proj": nn.Linear(HIDDEN, HIDDEN),  # row: bias replicated over TP
        "ln": nn.LayerNorm(HIDDEN),  # plain torch: unmarked
        "head": nn.Linear(HIDDEN, VOCAB),  # column, padded output rows
        "c_fc": Conv1D(VOCAB, HIDDEN),  # column along dim 1, padded
        "c_attn": Conv1D(3 * HIDDEN, HIDDEN),  # fused along dim 1
    }
    for m in mods.values():
        for p in m.parameters():
            p.data.normal_()  # no default init (LayerNorm ones) that would match by chance
    return mods


def _fastpar(mesh: ParallelMesh, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """fastpar's local tensors of the model drawn with ``seed`` under ``mesh``, and the dense
    tensors ({name: full tensor}, experts included)."""
    dense = _dense(seed)
    layers = {
        "emb": VocabParallelEmbedding.from_dense(dense["emb"], mesh=mesh),
        "qkv": ColumnParallelLinear.from_dense(dense["qkv"], fused=3, mesh=mesh),
        "proj": RowParallelLinear.from_dense(dense["proj"], mesh=mesh),
        "ln": dense["ln"],
        "head": ColumnParallelLinear.from_dense(dense["head"], pad_output=True, mesh=mesh),
        "c_fc": ColumnParallelLinear.from_dense(dense["c_fc"], pad_output=True, mesh=mesh),
        "c_attn": ColumnParallelLinear.from_dense(dense["c_attn"], fused=3, mesh=mesh),
    }
    params = dict(nn.ModuleDict(layers).named_parameters())
    full = {
        f"{k}.{n}": p.detach().clone() for k, m in dense.items() for n, p in m.named_parameters()
    }
    experts = torch.randn(EXPERTS, 6, HIDDEN)
    per = EXPERTS // mesh.ep_size
    e = nn.Parameter(experts[mesh.ep_rank * per : (mesh.ep_rank + 1) * per].clone())
    mark_expert(e, mesh.ep_group if mesh.ep_size > 1 else None, EXPERTS)
    params["experts"], full["experts"] = e, experts
    return params, full


def _expected(name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the dense tensor, laid out as fastpar lays ``p`` out."""
    ex = expert_layout(p)
    if ex is not None:
        world = 1 if ex.group is None else dist.get_world_size(ex.group)
        return full.chunk(world)[0 if ex.group is None else dist.get_rank(ex.group)]
    if param_layout(p) is None:
        return full
    return local_slice(full, p, 3 if name.split(".")[0] in ("qkv", "c_attn") else 1)


def _assert_holds(params, full, what: str) -> None:
    for name, p in params.items():
        want = _expected(name, p, full[name])
        assert torch.equal(p.detach(), want), f"{what}: {name} differs from the dense tensor"


def _round_trip_and_reshard(path: str) -> dict:
    saved_at = ParallelMesh(tp=2, ep=2)  # TP2 x DP2, experts over EP2
    params, full = _fastpar(saved_at, seed=0)
    _assert_holds(params, full, "built")  # the test's own slicing agrees with the layers
    state = to_dtensor_state_dict(params, saved_at)
    assert state["emb.weight"].shape == (VOCAB, HIDDEN)  # the global, unpadded tensor
    assert state["experts"].shape == (EXPERTS, 6, HIDDEN)
    check_dcp_state_dict(state)  # DTensors: accepted
    dcp.save(state, checkpoint_id=path)

    # the same layout, into a model drawn from another seed
    params, _ = _fastpar(saved_at, seed=1)
    state = to_dtensor_state_dict(params, saved_at)
    dcp.load(state, checkpoint_id=path)
    from_dtensor_state_dict(state, params, saved_at)
    _assert_holds(params, full, "TP2xDP2 -> TP2xDP2")

    # other layouts: TP4 (no EP), TP1 x DP4 with EP4
    for layout in (dict(tp=4), dict(tp=1, ep=4)):
        mesh = ParallelMesh(**layout)
        params, _ = _fastpar(mesh, seed=2)
        fp_dcp.load(params, path, mesh)
        _assert_holds(params, full, f"TP2xDP2 -> {layout}")
    return full


def test_dcp_round_trip_and_resharding_against_dense(tmp_path):
    path = str(tmp_path / "dcp")
    fulls = run_ranks(_round_trip_and_reshard, 4, path, timeout=120)
    # the checkpoint itself holds the dense tensors (q|k|v in true order, no padding rows):
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    saved = torch.load(str(tmp_path / "full.pt"))
    assert sorted(saved) == sorted(fulls[0])
    for name, want in fulls[0].items():
        assert torch.equal(saved[name], want), name


def _raw_dcp_trap(path: str) -> None:
    mesh = ParallelMesh(tp=2)
    params, _ = _fastpar(mesh, seed=0)
    local = {k: v for k, v in params.items() if k != "experts"}
    # the trap: plain shards save, and some rank reloads another rank's shard
    plain = {"w": local["qkv.weight"].detach().clone()}
    dcp.save(plain, checkpoint_id=path)
    back = {"w": torch.zeros_like(plain["w"])}
    dcp.load(back, checkpoint_id=path)
    kept = torch.tensor(float(torch.equal(back["w"], plain["w"])))
    dist.all_reduce(kept, op=dist.ReduceOp.MIN)
    assert kept == 0, "raw DCP gave every rank its own shard back"
    # the check refuses such a state dict: from the parameters, or a module's state_dict
    with pytest.raises(ValueError, match=r"'emb.weight'.*split over 2 ranks.*to_dtensor"):
        check_dcp_state_dict(local)
    model = ColumnParallelLinear(HIDDEN, VOCAB, pad_output=True, mesh=mesh)
    check_dcp_state_dict({"bias": torch.zeros(3)})  # nothing marked: accepted
    with pytest.raises(ValueError, match=r"'weight'.*split over 2 ranks"):
        check_dcp_state_dict(model.state_dict(), model)


def test_raw_dcp_on_plain_shards_is_wrong_and_refused(tmp_path):
    run_ranks(_raw_dcp_trap, 2, str(tmp_path / "raw"), timeout=120)
