"""``fastpar.parallelize`` on Hugging Face MoE models: the built-in plans turn every MoE block
into ``HFMoEBlock`` (fastpar's MoE under the block's own names, experts split over TP and over
the mesh's EP group). Against the dense HF model: logits, loss and every gradient at TP 2 ×
EP 2; training under DDP; ``save_hf`` writes a directory HF loads as the same model and
``load_hf`` reads it back into the sharded one; a DeepSeek-V3 block at TP 2 (shared experts,
expert bias updated through the gate) equals HF's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _hf import build
from _parity import assert_close, local_slice
from test_moe_hf_blocks import _block, _tokens

from fastpar import ParallelMesh, parallelize
from fastpar.checkpoint import load_hf, save_hf
from fastpar.moe import update_expert_bias
from fastpar.moe.hf_block import HFMoEBlock
from fastpar.nn.marks import expert_layout, param_layout
from fastpar.parallel import DistributedDataParallel
from fastpar.testing import run_ranks

pytest.importorskip("transformers", reason="the hf extra (pip install fastpar[hf])")
MOE_FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe"]


def _model(family: str):
    return build(family)


def _local(ref: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of the dense tensor ``ref`` laid out like parameter ``p``."""
    ex = expert_layout(p)
    if ex is not None and ex.group is not None and dist.get_world_size(ex.group) > 1:
        n = p.shape[0]
        ref = ref[dist.get_rank(ex.group) * n : (dist.get_rank(ex.group) + 1) * n]
    layout = param_layout(p)
    if layout is not None and layout.kind == "sharded":
        ref = local_slice(ref, p, layout.fused)
    return ref


def _batch(step: int, rows: int = 4, seq: int = 10):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 101, (rows, seq), generator=g)


def _grads_and_training(family: str, tmp: str):
    mesh = ParallelMesh(tp=2, ep=2)  # 4 ranks: dp 2, the experts split over both dp ranks
    dense = _model(family)
    model = parallelize(copy.deepcopy(dense), mesh=mesh)
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert blocks and all(b.moe.tp_layout == "expert_tp" and b.moe.ep == 2 for b in blocks)
    ids = _batch(0)
    half = slice(mesh.dp_rank * 2, mesh.dp_rank * 2 + 2)
    # one step on this replica's half: the dense model on the same half, except that an
    # expert's gradient sums the tokens of every EP rank (both halves)
    out = model(input_ids=ids[half], labels=ids[half])
    out.loss.backward()
    ref_loss, ref_grads = [], []
    for h in (slice(0, 2), slice(2, 4)):
        d = copy.deepcopy(dense)
        o = d(input_ids=ids[h], labels=ids[h])
        o.loss.backward()
        ref_loss.append(o)
        ref_grads.append(dict(d.named_parameters()))
    mine = ref_loss[mesh.dp_rank]
    assert_close(out.logits, mine.logits, "logits")
    assert_close(out.loss, mine.loss, "loss")
    names = set()
    for name, p in model.named_parameters():
        names.add(name)
        expert = expert_layout(p) is not None
        want = (
            sum(g[name].grad for g in ref_grads) if expert else ref_grads[mesh.dp_rank][name].grad
        )
        assert_close(p.grad, _local(want, p), f"grad of {name}")
    assert names == {n for n, _ in dense.named_parameters()}  # HF's names, all of them
    # training: DDP over the replicas equals the dense model on the whole batch
    model = parallelize(copy.deepcopy(dense), mesh=mesh)
    ddp = DistributedDataParallel(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref = copy.deepcopy(dense)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        ids = _batch(step + 1)
        ddp(input_ids=ids[half], labels=ids[half]).loss.backward()
        opt.step()
        opt.zero_grad()
        # the replicas' mean loss: each half's loss / 2 (an expert sees both halves)
        loss = sum(ref(input_ids=ids[h], labels=ids[h]).loss for h in (slice(0, 2), slice(2, 4)))
        (loss / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    trained = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, _local(trained[name], p), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"after 3 steps {n}: {m}")  # fmt: skip
    # the sharded model saves as the HF model, and loads back
    save_hf(model, tmp, mesh=mesh)
    fresh = parallelize(_model(family), mesh=mesh)
    load_hf(fresh, tmp)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), f"load_hf: {name}"
    converted = [n for n, _ in model.named_parameters() if n.endswith("gate_up_proj")]
    return converted, {n: t.detach().clone() for n, t in trained.items()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_model_at_tp2_ep2_equals_dense_and_saves_as_hf(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    names, trained = run_ranks(_grads_and_training, 4, family, str(tmp_path), timeout=240)[0]
    assert names, "no MoE block was converted"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float()
    got = dict(loaded.named_parameters())
    assert set(got) == set(trained)
    for name, t in trained.items():  # what HF loads is the dense model trained alike
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5, msg=name)


def _deepseek(tp: int):
    mesh = ParallelMesh(tp=tp)
    block = _block("deepseek_v3")
    ours = HFMoEBlock(copy.deepcopy(block), mesh=mesh)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in block.named_parameters()}
    assert "gate.e_score_correction_bias" in ours.state_dict()
    x, g = _tokens(0, 13)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    (block(xr) * g).sum().backward()
    y = ours(xo)
    (y * g).sum().backward()
    assert_close(y, block(x), "output")
    assert_close(xo.grad, xr.grad, "input grad")
    ref = dict(block.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, _local(ref[name].grad, p), f"grad of {name}")
    before = ours.gate.e_score_correction_bias.clone()
    assert update_expert_bias(ours) == 1  # found through the gate; counts of its forward
    assert not torch.equal(before, ours.gate.e_score_correction_bias)
    return float((ours.gate.e_score_correction_bias - before).abs().max())


def test_deepseek_v3_block_at_tp2_equals_hf_and_updates_its_bias():
    _block("deepseek_v3")  # skips when this transformers lacks the block
    steps = run_ranks(_deepseek, 2, 2)
    assert steps[0] == pytest.approx(1e-3, rel=1e-5) and steps[0] == steps[1]


def _router_logits_refused() -> str:
    model = build("mixtral", output_router_logits=True)
    try:
        parallelize(model, mesh=ParallelMesh(tp=2))
    except ValueError as e:
        return str(e)
    return ""


def test_hf_router_aux_loss_is_refused_rather_than_lost():
    """HF's own router aux loss reads logits off its router modules, which converted blocks do
    not have: parallelize refuses instead of silently dropping that loss term."""
    msg = run_ranks(_router_logits_refused, 2)[0]
    assert "output_router_logits=True" in msg and "output_router_logits=False" in msg
