"""torch.distributed.checkpoint through fastpar.checkpoint.dcp: a DTensor state dict from the
marks saves the true global tensors (unpadded, q|k|v unfused) and reloads under other layouts;
raw DCP on plain shards is the trap the check refuses."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _mesh import make_mesh
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
from fastpar.mesh import placement
from fastpar.mesh.placement import copy_marks, mark_sharded, marked_shard_of
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.nn.marks import expert_layout, mark_expert, param_layout
from fastpar.testing import run_ranks
from fastpar.zero import ZeroOptimizer

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
    saved_at = make_mesh(tp=2, ep=2, dp=2)  # experts over EP2
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
        mesh = make_mesh(**layout)
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
    mesh = make_mesh(tp=2)
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


def _tp_model(mesh: ParallelMesh) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "col": ColumnParallelLinear(HIDDEN, VOCAB, pad_output=True, mesh=mesh),
            "ln": nn.LayerNorm(HIDDEN),  # unmarked: replicated
            "row": RowParallelLinear(HIDDEN, HIDDEN, mesh=mesh),  # bias marked replicated
        }
    )


def _repoint_into_flat(model: nn.Module) -> torch.Tensor:
    """Move every parameter's data into one new flat buffer, as ZeRO does after marking."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        view = flat[offset : offset + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        offset += p.numel()
    return flat


def _state_dict_check() -> None:
    mesh = make_mesh(tp=2)
    model = _tp_model(mesh)
    # model.state_dict() holds detached tensors without marks: traced by their memory
    with pytest.raises(ValueError, match=r"state_dict\['col.weight'\] is this rank's shard.*2"):
        check_dcp_state_dict(model.state_dict())
    some = {k: model.state_dict()[k] for k in ("ln.weight", "row.bias", "row.weight")}
    with pytest.raises(ValueError, match=r"state_dict\['row.weight'\].*split over 2 ranks"):
        check_dcp_state_dict(some)
    with pytest.raises(ValueError, match=r"state_dict\['col.weight'\].*split over 2 ranks"):
        check_dcp_state_dict(dict(model.named_parameters()))
    with pytest.raises(ValueError, match=r"state_dict\['col.weight'\].*split over 2 ranks"):
        check_dcp_state_dict(model.state_dict(), model=model)
    # the module state dict under other names (a wrapper's prefix) is still traced
    with pytest.raises(ValueError, match=r"state_dict\['model.col.bias'\]"):
        check_dcp_state_dict({"model.col.bias": model.state_dict()["col.bias"]})
    # the replicated entries alone pass; a copy cannot be traced (documented)
    check_dcp_state_dict(
        {k: v for k, v in model.state_dict().items() if k.startswith(("ln", "row.b"))}
    )
    check_dcp_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    # DTensors of the same parameters (their locals are views of the shards) pass
    state = to_dtensor_state_dict(dict(model.named_parameters()), mesh)
    check_dcp_state_dict(state)
    # a model with only replicated parameters passes
    plain = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN))
    check_dcp_state_dict(plain.state_dict())
    check_dcp_state_dict(plain.state_dict(), model=plain)
    # parameters re-pointed into a flat buffer after marking are found at their new memory
    flat = _repoint_into_flat(model)
    sd = model.state_dict()
    assert flat.data_ptr() <= sd["row.weight"].data_ptr() < flat.data_ptr() + flat.nbytes
    with pytest.raises(ValueError, match=r"state_dict\['row.weight'\].*split over 2 ranks"):
        check_dcp_state_dict({"row.weight": sd["row.weight"]})
    # and by fastpar's ZeRO, which flattens the parameters into its buffers
    zmodel = _tp_model(mesh)
    before = zmodel["col"].weight.data_ptr()
    ZeroOptimizer(torch.optim.SGD(zmodel.parameters(), lr=0.1), stage=1, mesh=mesh)
    assert zmodel["col"].weight.data_ptr() != before  # now a view of ZeRO's flat buffer
    with pytest.raises(ValueError, match=r"state_dict\['col.weight'\].*split over 2 ranks"):
        check_dcp_state_dict(zmodel.state_dict())
    # experts split over EP, detached
    experts = nn.Parameter(torch.randn(2, 6, HIDDEN))
    mark_expert(experts, make_mesh(ep=2).ep_group, EXPERTS)
    with pytest.raises(ValueError, match=r"state_dict\['experts'\].*split over 2 ranks"):
        check_dcp_state_dict({"experts": experts.detach()})


def test_check_refuses_detached_shards_however_called():
    run_ranks(_state_dict_check, 2, timeout=120)


def _nested_check() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = make_mesh(tp=2)
    model = _tp_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the moments exist
    # a module's state dict one level down (a trainer's {"model": ..., "optim": ...})
    with pytest.raises(ValueError, match=r"state_dict\['model'\]\['col.weight'\].*split over 2"):
        check_dcp_state_dict({"model": model.state_dict(), "step": 3})
    with pytest.raises(ValueError, match=r"state_dict\['parts'\]\[1\]\['w'\].*split over 2"):
        check_dcp_state_dict({"parts": [{}, {"w": model["row"].weight.detach()}]})
    # the optimizer's moments of a split weight are shards too (their own tensors, no marks):
    # torch's get_state_dict keys them by the parameter's name; the step count passes
    model_sd, optim_sd = get_state_dict(model, opt)
    state = optim_sd["state"]
    assert state["col.weight"]["exp_avg"].shape == model["col"].weight.shape
    with pytest.raises(ValueError, match=r"\['state'\]\['col.weight'\]\['exp_avg'\].*split"):
        check_dcp_state_dict({"optim": optim_sd}, model)
    replicated = {k: v for k, v in state.items() if k.startswith(("ln", "row.bias"))}
    check_dcp_state_dict({"optim": {"state": replicated}}, model)
    # torch's own optimizer.state_dict() numbers the parameters: traced with optimizer=
    numbered = opt.state_dict()
    first = next(i for i, p in enumerate(model.parameters()) if p is model["col"].weight)
    with pytest.raises(ValueError, match=rf"\['state'\]\[{first}\]\['exp_avg'\].*split"):
        check_dcp_state_dict({"optim": numbered}, optimizer=opt)
    # without the optimizer its numbers name nothing: documented as not traced
    check_dcp_state_dict({"optim": numbered})
    del model_sd


def test_check_looks_inside_nested_dicts_and_the_optimizer_state():
    run_ranks(_nested_check, 2, timeout=120)


def test_marked_shard_registry_holds_parameters_weakly():
    p = nn.Parameter(torch.randn(4, 3))
    e = nn.Parameter(torch.randn(2, 3))
    mark_sharded(p, 0, None, 8)
    mark_expert(e, None, 4)
    q = nn.Parameter(torch.randn(4, 3))  # e.g. a wrapper's replacement of p
    copy_marks(p, q)
    assert marked_shard_of(p.detach()) is p and marked_shard_of(p.data) is p
    assert marked_shard_of(e.detach()) is e and marked_shard_of(q.detach()) is q
    assert marked_shard_of(p.detach().clone()) is None  # a copy: not traced
    assert marked_shard_of(p.detach()[:2]) is None  # another shape: not the parameter
    assert marked_shard_of(p.detach().t()) is None  # another stride
    refs, ids = [weakref.ref(t) for t in (p, e, q)], [id(t) for t in (p, e, q)]
    del p, e, q
    gc.collect()
    assert all(r() is None for r in refs), "the registry keeps dead parameters alive"
    assert not any(i in placement._MARKED_SHARDS for i in ids)
