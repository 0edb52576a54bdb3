"""fastpar's LoRA against Hugging Face PEFT's own (peft==0.21.2, the ``peft`` extra) on a tiny
Llama (random init from a config; nothing is downloaded), adapters on q, k, v, o, gate, up and
down:

* single process: ``apply_lora`` under the seed PEFT's ``get_peft_model`` drew under draws the
  same A bit for bit; with the same B (non-zero, copied), the logits, the loss and every
  adapter gradient equal PEFT's bit for bit (the same kernels on the same shapes, in the same
  order: PEFT's LoRA forward is base(x) + lora_B(lora_A(dropout(x))) · scaling, so is ours);
* TP 2: ``parallelize`` first, then ``apply_lora`` on its Column/RowParallelLinear layers: the
  logits and every adapter gradient (this rank's part; a whole factor's the same bits on every
  rank) agree with PEFT's single-process run by the tolerance rule (docs/tolerances.md);
* PEFT files both ways: ``save_peft`` (TP 1 and 2) then ``peft.PeftModel.from_pretrained`` gives
  the same logits; PEFT's ``save_pretrained`` then ``load_peft`` gives PEFT's logits.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from _hf import agree_runs, batch, build, dense_runs, lm_loss, longest_reduction
from _mesh import make_mesh
from _parity import local_part, same_on_every_rank

from fastpar import parallelize
from fastpar.checkpoint.hf import save_hf
from fastpar.checkpoint.lora import load_peft, save_peft
from fastpar.nn.lora import apply_lora, lora_modules, lora_parameters, merge_lora
from fastpar.testing import run_ranks

peft = pytest.importorskip("peft", reason="the peft extra (pip install fastpar[peft])")
transformers = pytest.importorskip("transformers")

FAMILY = "llama"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA, SEED = 4, 8, 21


def peft_name(name: str) -> str:
    """fastpar's adapter name -> PEFT's parameter name (adapter "default")."""
    return f"base_model.model.{name}.default.weight"


def peft_model(dense, targets=TARGETS, **options):
    """PEFT's LoRA on a copy of ``dense`` (A drawn under ``SEED``), every B set non-zero (PEFT's
    zero B would hide B's part of A's gradient)."""
    torch.manual_seed(SEED)
    cfg = peft.LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0, **options
    )
    model = peft.get_peft_model(copy.deepcopy(dense), cfg)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) / 4)
    return model


def fastpar_lora(model, peft_params: dict, targets: str = "q,k,v,o,gate,up,down") -> list[str]:
    """``apply_lora`` on ``model`` under PEFT's seed (A: the same draws), B copied from PEFT's
    (this rank's part); asserts that A came out equal to PEFT's bit for bit."""
    torch.manual_seed(SEED)
    names = apply_lora(model, targets, R, ALPHA)
    with torch.no_grad():
        for name, p in lora_parameters(model):
            full = peft_params[peft_name(name)].detach()
            if name.endswith("lora_A"):
                assert torch.equal(p, local_part(full, p)), f"{name}: A is not PEFT's draw"
            else:
                p.copy_(local_part(full, p))
    return names


def test_single_process_equals_peft_bit_for_bit():
    dense = build(FAMILY)
    ref = peft_model(dense)
    ours = copy.deepcopy(dense)
    names = fastpar_lora(ours, dict(ref.named_parameters()))
    assert len(names) == 7 * 2  # 7 targets x 2 layers
    ids, labels = batch(FAMILY, 0)
    want, got = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.equal(got, want)  # the same kernels, shapes and order: bit for bit
    lm_loss(FAMILY, want, labels).backward()
    lm_loss(FAMILY, got, labels).backward()
    theirs = dict(ref.named_parameters())
    trained = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert sorted(trained) == sorted(n for n, _ in lora_parameters(ours))
    for name, p in lora_parameters(ours):
        assert torch.equal(p.grad, theirs[peft_name(name)].grad), name
    assert all(p.grad is None for n, p in ours.named_parameters() if not p.requires_grad)


def _tp_parity(tp: int) -> int:
    dense = build(FAMILY)
    ref = peft_model(dense)
    ids, labels = batch(FAMILY, 0)
    n = longest_reduction(FAMILY)
    runs = dense_runs(FAMILY, ref, ids, labels)  # PEFT's fp32 run, its twin, its float64 run
    mesh = make_mesh(tp=tp)
    par = parallelize(copy.deepcopy(dense), mesh=mesh)
    fastpar_lora(par, dict(ref.named_parameters()))
    kinds = {name.rsplit(".", 1)[-1]: m.kind for name, m in lora_modules(par)}
    assert kinds == dict.fromkeys(TARGETS, "column") | {"o_proj": "row", "down_proj": "row"}
    logits = par(input_ids=ids).logits
    agree_runs(logits, runs, lambda r: r[0], "logits", n)
    loss = lm_loss(FAMILY, logits, labels)
    agree_runs(loss, runs, lambda r: r[1], "loss", n)
    loss.backward()
    count = 0
    for name, p in lora_parameters(par):
        cut = lambda t, p=p: local_part(t, p)  # noqa: E731
        key = peft_name(name)
        agree_runs(p.grad, runs, lambda r, k=key: r[2][k], f"grad of {name}", n, cut)
        if local_part(runs[0][2][key], p) is runs[0][2][key]:
            same_on_every_rank(p.grad, mesh.tp_group, f"grad of whole {name}")
        count += 1
    assert all(p.grad is None for p in par.parameters() if not p.requires_grad)
    return count


@pytest.mark.parametrize("tp", [2])
def test_tp_matches_peft_single_process(tp):
    assert run_ranks(_tp_parity, tp, tp) == [7 * 2 * 2] * tp


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _save_then_peft_loads(tp: int, directory: str) -> bool:
    """fastpar's adapters (TP ``tp``) -> save_peft -> PEFT's from_pretrained on rank 0: PEFT's
    logits equal those of PEFT's own model of the same adapters, bit for bit (the gather is a
    copy); at TP 1 they equal fastpar's too, bit for bit."""
    dense = build(FAMILY)
    ref = peft_model(dense)
    ids, _ = batch(FAMILY, 0)
    ours = copy.deepcopy(dense)
    if tp > 1:
        ours = parallelize(ours, mesh=make_mesh(tp=tp))
    fastpar_lora(ours, dict(ref.named_parameters()))
    save_peft(ours, directory)
    if dist.get_rank() != 0:
        return True
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (R, ALPHA, "LORA")
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(dense), directory)
    got = _logits(loaded, ids)
    assert torch.equal(got, _logits(ref, ids))
    if tp == 1:
        assert torch.equal(got, _logits(ours, ids))
    return True


@pytest.mark.parametrize("tp", [1, 2])
def test_save_peft_loads_in_peft(tp, tmp_path):
    assert all(run_ranks(_save_then_peft_loads, tp, tp, str(tmp_path)))


def _peft_saves_fastpar_loads(tp: int, directory: str) -> int:
    """PEFT's save_pretrained -> load_peft onto the base (TP ``tp``): PEFT's logits, bit for bit
    at TP 1, by the rule at TP 2."""
    dense = build(FAMILY)
    ref = peft_model(dense)
    if dist.get_rank() == 0:
        ref.save_pretrained(directory)
    dist.barrier()
    ids, labels = batch(FAMILY, 0)
    ours = copy.deepcopy(dense)
    if tp > 1:
        ours = parallelize(ours, mesh=make_mesh(tp=tp))
    names = load_peft(ours, directory)
    trained = sorted(n for n, p in ours.named_parameters() if p.requires_grad)
    assert trained == sorted(n for n, _ in lora_parameters(ours))
    if tp == 1:
        assert torch.equal(_logits(ours, ids), _logits(ref, ids))
        wrapped = copy.deepcopy(dense)  # adapters already there: load_peft fills them
        apply_lora(wrapped, "q,k,v,o,gate,up,down", R, ALPHA)
        assert load_peft(wrapped, directory) == names
        assert torch.equal(_logits(wrapped, ids), _logits(ref, ids))
    else:
        runs = dense_runs(FAMILY, ref, ids, labels)
        agree_runs(_logits(ours, ids), runs, lambda r: r[0], "logits", longest_reduction(FAMILY))
    return len(names)


@pytest.mark.parametrize("tp", [1, 2])
def test_peft_saves_fastpar_loads(tp, tmp_path):
    assert run_ranks(_peft_saves_fastpar_loads, tp, tp, str(tmp_path)) == [7 * 2] * tp


def _merged_export(tp: int, directory: str) -> bool:
    """``merge_lora`` then ``save_hf``: a plain transformers model. At TP 1 its weights equal
    PEFT's ``merge_and_unload`` bit for bit (the same W + (B @ A) · scaling in fp32); at TP 1
    and 2 the reloaded model's logits agree with PEFT's merged model's by the rule."""
    dense = build(FAMILY)
    ref = peft_model(dense)
    ids, labels = batch(FAMILY, 0)
    ours = copy.deepcopy(dense)
    if tp > 1:
        ours = parallelize(ours, mesh=make_mesh(tp=tp))
    fastpar_lora(ours, dict(ref.named_parameters()))
    assert len(merge_lora(ours)) == 7 * 2
    assert not any(".lora_" in n or "base_layer" in n for n, _ in ours.named_parameters())
    save_hf(ours, directory)
    if dist.get_rank() != 0:
        return True
    merged = copy.deepcopy(ref).merge_and_unload()
    merged.requires_grad_(True)  # dense_runs takes its gradients too
    if tp == 1:
        theirs = merged.state_dict()
        for name, t in ours.state_dict().items():
            assert torch.equal(t, theirs[name]), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    runs = dense_runs(FAMILY, merged, ids, labels)
    n = longest_reduction(FAMILY)
    agree_runs(_logits(reloaded, ids), runs, lambda r: r[0], "merged logits", n)
    return True


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_export_is_a_plain_transformers_model(tp, tmp_path):
    assert all(run_ranks(_merged_export, tp, tp, str(tmp_path)))


def test_dropout_draws_peft_mask():
    """lora_dropout 0.1 in training mode: under the same seed fastpar draws PEFT's masks (the
    same nn.Dropout on the same inputs in the same module order), so the logits and the adapter
    gradients are PEFT's bit for bit."""
    dense = build(FAMILY)
    torch.manual_seed(SEED)
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.1)
    ref = peft.get_peft_model(copy.deepcopy(dense), cfg)
    ours = copy.deepcopy(dense)
    torch.manual_seed(SEED)
    apply_lora(ours, "q,k,v,o,gate,up,down", R, ALPHA, dropout=0.1)
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in lora_parameters(ours):
            p.copy_(theirs[peft_name(name)] + 0.1 * name.endswith("lora_B"))
            theirs[peft_name(name)].copy_(p)
    ref.train()
    ours.train()
    ids, labels = batch(FAMILY, 0)
    outs = []
    for model in (ref, ours):
        torch.manual_seed(9)
        outs.append(model(input_ids=ids).logits)
        lm_loss(FAMILY, outs[-1], labels).backward()
    assert torch.equal(outs[0], outs[1])
    with torch.no_grad():
        torch.manual_seed(10)
        assert not torch.equal(ours(input_ids=ids).logits, outs[1])  # another mask
    for name, p in lora_parameters(ours):
        assert torch.equal(p.grad, theirs[peft_name(name)].grad), name


GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


def _gpt2(tp: int, directory: str) -> int:
    """GPT-2's Conv1D layers ([in, out] weights; c_attn a fused q|k|v), PEFT with
    fan_in_fan_out: bit for bit in one process; under parallelize at TP 2 (c_attn a fused,
    transposed column layer, c_proj row) by the rule; save_peft -> PEFT loads the same adapters
    (its logits bit for bit those of PEFT's own model)."""
    dense = build("gpt2")
    ref = peft_model(dense, GPT2_TARGETS, fan_in_fan_out=True)
    ids, labels = batch("gpt2", 0)
    ours = copy.deepcopy(dense)
    if tp > 1:
        ours = parallelize(ours, mesh=make_mesh(tp=tp))
    names = fastpar_lora(ours, dict(ref.named_parameters()), ",".join(GPT2_TARGETS))
    logits = ours(input_ids=ids).logits
    if tp == 1:
        assert torch.equal(logits, ref(input_ids=ids).logits)
    runs = dense_runs("gpt2", ref, ids, labels)
    n = longest_reduction("gpt2")
    agree_runs(logits, runs, lambda r: r[0], "logits", n)
    lm_loss("gpt2", logits, labels).backward()
    for name, p in lora_parameters(ours):
        key = peft_name(name)
        cut = lambda t, p=p: local_part(t, p)  # noqa: E731
        agree_runs(p.grad, runs, lambda r, k=key: r[2][k], f"grad of {name}", n, cut)
    save_peft(ours, directory)
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "adapter_config.json")) as f:
            assert json.load(f)["fan_in_fan_out"] is True
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(dense), directory)
        assert torch.equal(_logits(loaded, ids), _logits(ref, ids))
    return len(names)


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt2_conv1d_equals_peft(tp, tmp_path):
    assert (
        run_ranks(_gpt2, tp, tp, str(tmp_path)) == [4 * 2] * tp
    )  # c_attn, attn.c_proj, c_fc, mlp.c_proj
