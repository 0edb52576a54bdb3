"""parallelize() on Hugging Face models with the built-in plans (the refusals:
tests/test_nn_parallelize_hf_refusals.py).

Each family with a built-in plan (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE attention,
GPT-2 with its Conv1D layers, BERT with its tied decoder bias), built by ``transformers`` from a
small config: logits, loss and every gradient on every rank agree with the dense model's at TP
2 and 4; 5 AdamW steps under DDP, ZeRO-1, ZeRO-2 and Zero3 at DP2 and TP2xDP2 agree with
single-process training on the full batch; generate() with the KV cache of the local heads;
docs/hf.md's plan of one's own.

"Agree" is ``fastpar.tolerance``'s rule (docs/tolerances.md): the parallel model's partial sums
and all-reduces round otherwise than the dense model, so each quantity is judged against the
same math in float64 (the dense model ``.double()``; its reference loss is a float64
cross-entropy, not HF's, which casts the logits to fp32), within a few times the fp32 dense
run's own error; after AdamW steps with its per-element slack (``train_references``).
Replicated gradients are equal bit for bit across the TP group (one all-reduce's result).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from _hf import (
    FAMILIES,
    agree_grads,
    agree_runs,
    batch,
    build,
    dense_runs,
    exact,
    generate_at_tp2,
    longest_reduction,
    loss_of,
    readme_plan,
)
from _mesh import make_mesh
from _parity import agree

from fastpar import parallelize
from fastpar.checkpoint.state import localize
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, param_layout
from fastpar.optim import FusedAdamW
from fastpar.parallel import DistributedDataParallel
from fastpar.testing import run_ranks
from fastpar.tolerance import References, train_references
from fastpar.zero import Zero3, ZeroOptimizer

QK_NORMS = {"qwen3", "qwen3_moe"}


def _one_step(family: str, tp: int) -> list:
    dense = build(family)
    par = copy.deepcopy(dense)
    mesh = make_mesh(tp=tp)
    parallelize(par, mesh=mesh)
    ids, labels = batch(family, 0)
    n = longest_reduction(family)
    runs = dense_runs(family, dense, ids, labels)
    out_p = par(input_ids=ids, labels=labels)
    agree_runs(out_p.logits, runs, lambda r: r[0], "logits", n)
    agree_runs(out_p.loss, runs, lambda r: r[1], "loss", n)
    out_p.loss.backward()
    assert agree_grads(par, runs, n, mesh.tp_group) == len(runs[0][2])
    plan = par.fastpar_plan
    return [plan.grad_reduced, plan.probed, plan.output_rel_diff]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_dense(family, tp):
    results = run_ranks(_one_step, tp, family, tp)
    reduced, probed, rel = results[0]
    assert probed and rel < 1e-5
    if family in QK_NORMS:  # the per-head norms are found and reduced; nothing else is
        assert reduced and all(n.endswith(("q_norm.weight", "k_norm.weight")) for n in reduced)
        assert len(reduced) == 2 * 2  # 2 layers x (q_norm, k_norm)
    else:
        assert reduced == []


def _decoder_layer(model) -> type:
    return next(
        type(m) for n, m in model.named_modules() if n.endswith(("layers.0", "h.0", "layer.0"))
    )


def _train(family: str, tp: int, wrapper: str, refs: References, steps: int = 5) -> None:
    """5 AdamW steps of the parallel model under ``wrapper``: each step's loss (the replicas'
    mean) and every parameter of this rank afterwards against the references."""
    mesh = make_mesh(tp=tp)
    model = parallelize(build(family), mesh=mesh)
    rows = 4 // mesh.dp_size
    losses = []

    def local(step):
        ids, labels = batch(family, step)
        sl = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
        return ids[sl], labels[sl]

    engine = None
    if wrapper == "zero3":
        engine = Zero3(
            model,
            lambda ps: FusedAdamW(ps, lr=1e-2, weight_decay=0.01),
            mesh=mesh,
            wrap=(_decoder_layer(model),),
        )
        forward, opt = engine, engine
    elif wrapper == "ddp":
        forward = DistributedDataParallel(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    else:
        forward = model
        opt = ZeroOptimizer(
            FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
            stage=int(wrapper[-1]),
            mesh=mesh,
        )
    for step in range(steps):
        ids, labels = local(step)
        loss = forward(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    # each replica's loss is the mean over its half; their average is the full batch's
    mean = torch.stack(losses).clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    for step in range(steps):
        c = refs.loss(step, float(mean[step]))
        assert c.ok, f"{wrapper}: {c}"
    with engine.summon_full_params() if engine is not None else contextlib.nullcontext():
        named = dict(model.named_parameters())
        refs.local = lambda t, n: localize(t, named[n])  # this rank's part of a full tensor
        for name, p in named.items():
            # AdamW normalises a gradient that is zero up to rounding (BERT's key bias, the
            # embedding row of a token the batches lack) into lr-sized steps that rounding
            # steers: ``param`` allows, per element, what AdamW makes of the gradients' bounds
            c = refs.param(name, p.detach())
            assert c.ok, f"{wrapper}: {c}"


def _train_all(family: str, tp: int, refs: References) -> None:
    for wrapper in ("ddp", "zero1", "zero2", "zero3"):
        _train(family, tp, wrapper, refs)


def _reference(family: str, steps: int = 5) -> References:
    """Single-process AdamW on the full batches: fp32, its twin and float64."""

    def loss(model, step, dtype):
        return loss_of(family, model, *batch(family, step))

    # (train_references casts with fastpar.tolerance.cast: float64 MoE experts run HF's loop)
    return train_references(
        lambda: build(family),
        loss,
        steps,
        length=longest_reduction(family),
        lr=1e-2,
        weight_decay=0.01,
    )


@pytest.mark.parametrize("layout", ["dp2", "tp2-dp2"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_under_every_data_parallel_wrapper(family, layout):
    tp, world = (1, 2) if layout == "dp2" else (2, 4)
    run_ranks(_train_all, world, family, tp, _reference(family), timeout=240)


# -- the families' own layouts: GPT-2's Conv1D, BERT's tied decoder bias --------------------
def _gpt2_as_linear() -> list:
    """GPT-2 with its Conv1D layers converted to nn.Linear by hand (a user's old workaround):
    split_size is found without heads=."""
    dense = build("gpt2")
    for block in dense.transformer.h:
        for parent, attr in (
            (block.attn, "c_attn"),
            (block.attn, "c_proj"),
            (block.mlp, "c_fc"),
            (block.mlp, "c_proj"),
        ):
            conv = getattr(parent, attr)
            lin = torch.nn.Linear(*conv.weight.shape)
            with torch.no_grad():
                lin.weight.copy_(conv.weight.t())
                lin.bias.copy_(conv.bias)
            setattr(parent, attr, lin)
    dense64 = exact(dense)
    par = parallelize(copy.deepcopy(dense), mesh=make_mesh(tp=2))
    ids, _ = batch("gpt2", 0)
    logits_d, logits_64 = (m(input_ids=ids).logits for m in (dense, dense64))
    agree(
        par(input_ids=ids).logits, logits_d, logits_64, "logits", length=longest_reduction("gpt2")
    )
    return [type(par.transformer.h[0].attn.c_attn).__name__, par.transformer.h[0].attn.split_size]


def test_gpt2_with_linear_layers_needs_no_heads_argument():
    assert run_ranks(_gpt2_as_linear, 2)[0] == ["ColumnParallelLinear", 16]


def _gpt2_conv1d_layout() -> list:
    par = parallelize(build("gpt2"), mesh=make_mesh(tp=2))
    attn = par.transformer.h[0].attn
    assert isinstance(attn.c_attn, ColumnParallelLinear) and attn.c_attn.transposed
    assert isinstance(attn.c_proj, RowParallelLinear) and attn.c_proj.transposed
    lay_c, lay_r = param_layout(attn.c_attn.weight), param_layout(attn.c_proj.weight)
    return [tuple(attn.c_attn.weight.shape), lay_c.dim, lay_c.fused, lay_r.dim, attn.num_heads]


def test_gpt2_conv1d_keeps_the_hugging_face_layout():
    # [in, out] as in the HF checkpoint: column splits shard dim 1 (fused q|k|v), rows dim 0
    assert run_ranks(_gpt2_conv1d_layout, 2)[0] == [(32, 48), 1, 3, 0, 2]


def _bert_ties() -> list:
    par = parallelize(build("bert"), mesh=make_mesh(tp=2))
    pred = par.cls.predictions
    return [
        pred.bias is pred.decoder.bias,
        pred.decoder.weight is par.bert.embeddings.word_embeddings.weight,
        tuple(pred.bias.shape),
        param_layout(pred.bias).kind,
    ]


def test_bert_decoder_bias_is_sharded_with_its_module():
    assert run_ranks(_bert_ties, 2)[0] == [True, True, (51,), "sharded"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_on_a_tensor_parallel_model(family):
    out = run_ranks(generate_at_tp2, 2, family)
    assert out[0] == out[1] and len(out[0][0]) == 11


def _readme_snippet(plan: dict) -> list:
    dense = build("qwen3")
    par = parallelize(copy.deepcopy(dense), plan, make_mesh(tp=2))
    ids, _ = batch("qwen3", 0)
    n = longest_reduction("qwen3")
    runs = dense_runs("qwen3", dense, ids, ids)
    loss_p = par(input_ids=ids, labels=ids).loss
    agree_runs(loss_p, runs, lambda r: r[1], "loss", n)
    loss_p.backward()
    agree_grads(par, runs, n)
    return par.fastpar_plan.found_by_probe


def test_the_readme_plan_is_correct_for_qwen3():
    plan = readme_plan()
    assert plan["model.layers.*.self_attn.[qkv]_proj"] == "column"
    assert run_ranks(_readme_snippet, 2, plan)[0] == []  # every per-head norm was declared
