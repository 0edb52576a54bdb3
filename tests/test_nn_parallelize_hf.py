"""parallelize() on Hugging Face models with the built-in plans, and every refusal.

Each family with a built-in plan (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE attention,
GPT-2 with its Conv1D layers, BERT with its tied decoder bias), built by ``transformers`` from a
small config: logits, loss and every gradient on every rank agree with the dense model's at TP
2 and 4; 5 AdamW steps under DDP, ZeRO-1, ZeRO-2 and Zero3 at DP2 and TP2xDP2 agree with
single-process training on the full batch. Then the plans that must be refused, with their
messages.

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
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _hf import FAMILIES, VOCAB, build, exact
from _mesh import make_mesh
from _parity import agree, local_slice

import fastpar
from fastpar import parallelize
from fastpar.checkpoint.state import localize
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, param_layout
from fastpar.optim import FusedAdamW
from fastpar.parallel import DistributedDataParallel
from fastpar.parity import reduction_length
from fastpar.testing import RankError, run_ranks
from fastpar.tolerance import References, nudge, train_references
from fastpar.zero import Zero3, ZeroOptimizer

QK_NORMS = {"qwen3", "qwen3_moe"}


def _batch(family: str, step: int, rows: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    if family == "bert":  # masked LM: 3 labelled positions per row (replicas average alike)
        labels = torch.full_like(ids, -100)
        for r in range(rows):
            pos = torch.randperm(seq, generator=g)[:3]
            labels[r, pos] = ids[r, pos]
        return ids, labels
    return ids, ids


def _lm_loss(family: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's ``labels=`` loss written out in the logits' dtype (HF's casts the logits to
    fp32, which would make the float64 reference only as exact as fp32)."""
    if family != "bert":  # causal: token t predicts t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _loss_of(family: str, model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _lm_loss(family, model(input_ids=ids).logits, labels)


def _dense_runs(family: str, dense, ids: torch.Tensor, labels: torch.Tensor) -> list:
    """The dense model's (logits, loss, gradients by name, ties under each name) on one batch:
    its fp32 run, its twin (every weight one ulp away: ``nudge``) and its float64 run."""
    twin = copy.deepcopy(dense)
    nudge(twin, seed=1)
    runs = []
    for model in (copy.deepcopy(dense), twin, exact(dense)):
        logits = model(input_ids=ids).logits
        loss = _lm_loss(family, logits, labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        runs.append((logits.detach(), loss.detach(), grads))
    return runs


def _agree_runs(actual, runs: list, pick, what: str, length: int, cut=lambda t: t) -> None:
    """The rule on ``actual`` against ``pick(run)`` of the fp32 run and its twin, and of the
    float64 run (each ``cut`` to this rank's part)."""
    single, twin, exact64 = (cut(pick(run)) for run in runs)
    agree(actual, [single, twin], exact64, what, length=length)


def _length(family: str) -> int:
    """The longest reduction of the tests' quantities: the batch's tokens or the widest
    parameter dimension (the vocabulary here)."""
    return reduction_length(build(family), _batch(family, 0)[0])


def _expected_grad(p: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    layout = param_layout(p)
    if layout is None or layout.kind == "replicated":
        return ref
    return local_slice(ref, p, layout.fused)


def _same_on_every_rank(t: torch.Tensor, group, what: str) -> None:
    # a replicated gradient is one all-reduce's result, the same bits on every rank
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    for r, other in enumerate(parts):
        torch.testing.assert_close(other, t, rtol=0, atol=0, msg=f"{what} differs on rank {r}")


def _one_step(family: str, tp: int) -> list:
    dense = build(family)
    par = copy.deepcopy(dense)
    mesh = make_mesh(tp=tp)
    parallelize(par, mesh=mesh)
    ids, labels = _batch(family, 0)
    n = _length(family)
    runs = _dense_runs(family, dense, ids, labels)
    out_p = par(input_ids=ids, labels=labels)
    _agree_runs(out_p.logits, runs, lambda r: r[0], "logits", n)
    _agree_runs(out_p.loss, runs, lambda r: r[1], "loss", n)
    out_p.loss.backward()
    count = 0
    for name, p in par.named_parameters(remove_duplicate=False):
        assert p.grad is not None, f"{name} got no gradient"
        _agree_runs(
            p.grad,
            runs,
            lambda r, k=name: r[2][k],
            f"grad of {name}",
            n,
            lambda t, p=p: _expected_grad(p, t),
        )
        layout = param_layout(p)
        if layout is None or layout.kind == "replicated":  # copies agree across the TP group
            _same_on_every_rank(p.grad, mesh.tp_group, f"grad of replicated {name}")
        count += 1
    assert count == len(runs[0][2])
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
        ids, labels = _batch(family, step)
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
        return _loss_of(family, model, *_batch(family, step))

    # (train_references casts with fastpar.tolerance.cast: float64 MoE experts run HF's loop)
    return train_references(
        lambda: build(family), loss, steps, length=_length(family), lr=1e-2, weight_decay=0.01
    )


@pytest.mark.parametrize("layout", ["dp2", "tp2-dp2"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_under_every_data_parallel_wrapper(family, layout):
    tp, world = (1, 2) if layout == "dp2" else (2, 4)
    run_ranks(_train_all, world, family, tp, _reference(family), timeout=240)


# -- refusals: checked before the model is used, each naming the value and the fix -----------
def _raises(fn, world: int, *args) -> str:
    with pytest.raises(RankError) as info:
        run_ranks(fn, world, *args)
    return str(info.value)


def _readme_snippet_of_old() -> None:
    parallelize(build("llama"), {"*.q_proj": "column", "*.o_proj": "row"}, make_mesh(tp=2))


def test_splitting_q_without_k_and_v_is_refused():
    msg = _raises(_readme_snippet_of_old, 2)
    assert "leaves ['model.layers.0.self_attn.k_proj', 'model.layers.0.self_attn.v_proj']" in msg
    assert "must be split together" in msg


def _kv_heads_at_tp8() -> None:
    parallelize(build("llama"), mesh=make_mesh(tp=8))


def test_kv_heads_from_the_config_must_divide_tp():
    # transformers 5 keeps head counts on config only: the check reads them there
    msg = _raises(_kv_heads_at_tp8, 8)
    assert "config.num_key_value_heads=4, not divisible by the tensor-parallel size 8" in msg
    assert "use a TP size in [1, 2, 4]" in msg


def _dense_linear_after_split() -> None:
    plan = fastpar.nn.plans.builtin_plan(build("llama"))
    plan["model.layers.*.mlp.down_proj"] = "replicate"  # consumes the split gate/up product
    parallelize(build("llama"), plan, make_mesh(tp=2))


def test_a_dense_linear_fed_by_a_split_is_refused():
    msg = _raises(_dense_linear_after_split, 2)
    assert "'model.layers.0.mlp.down_proj.weight' is contracted with a split activation" in msg
    assert "plan 'model.layers.0.mlp.down_proj' as 'row'" in msg


def _q_split_k_replicated() -> None:
    plan = fastpar.nn.plans.builtin_plan(build("llama"))
    plan["model.layers.*.self_attn.k_proj"] = "replicate"
    plan["model.layers.*.self_attn.v_proj"] = "replicate"
    parallelize(build("llama"), plan, make_mesh(tp=2))


def test_split_queries_against_whole_keys_are_refused():
    msg = _raises(_q_split_k_replicated, 2)
    assert "contracted (matmul in 'model.layers.0.self_attn')" in msg
    assert "split every projection that feeds this op together" in msg


def _wrong_declarations(which: str) -> None:
    family = "qwen3" if which == "replicate" else "llama"
    plan = fastpar.nn.plans.builtin_plan(build(family))
    if which == "replicate":
        plan["model.layers.*.self_attn.q_norm"] = "replicate"
    else:
        plan["model.layers.*.input_layernorm"] = "per_head"
    parallelize(build(family), plan, make_mesh(tp=2))


def test_wrong_per_head_or_replicate_declarations_are_refused():
    msg = _raises(_wrong_declarations, 2, "replicate")
    assert "marks 'model.layers.0.self_attn.q_norm' 'replicate' but its parameter" in msg
    assert "plan it as 'per_head'" in msg
    msg = _raises(_wrong_declarations, 2, "per_head")
    assert "'model.layers.0.input_layernorm' 'per_head' but it never sees a split" in msg


class _SharedNorm(torch.nn.Module):
    """One norm applied to the split heads and to the whole residual stream."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        h = self.norm(self.qkv(x).view(*x.shape[:-1], 4, 4)).flatten(-2)
        return self.proj(h) + self.norm(x.view(*x.shape[:-1], 4, 4)).flatten(-2)


def _shared_norm() -> None:
    parallelize(_SharedNorm(), {"qkv": "column", "proj": "row"}, group=None)


def test_a_parameter_on_split_and_whole_activations_is_refused():
    msg = _raises(_shared_norm, 2)
    assert re.search(r"'norm\.(weight|bias)' is used both on split activations", msg)


def _unprobed(declare: bool):
    mesh = make_mesh(tp=2)
    plan = fastpar.nn.plans.builtin_plan(build("qwen3"))
    if not declare:
        del plan["model.layers.*.self_attn.q_norm"], plan["model.layers.*.self_attn.k_norm"]
    model = parallelize(build("qwen3"), plan, mesh, check=False)
    return model.fastpar_plan.grad_reduced


def test_without_the_probe_per_head_parameters_must_be_declared():
    msg = _raises(_unprobed, 2, False)
    assert "'model.layers.0.self_attn.q_norm.weight' sits inside 'model.layers.0.self_attn'" in msg
    assert "Plan 'model.layers.0.self_attn.q_norm' as 'per_head'" in msg
    reduced = run_ranks(_unprobed, 2, True)[0]
    assert len(reduced) == 4


def _untied_head_left_dense() -> None:
    plan = fastpar.nn.plans.builtin_plan(build("qwen3"))  # qwen3 here ties its embeddings
    del plan["lm_head"]
    parallelize(build("qwen3"), plan, make_mesh(tp=2))


def test_a_tied_copy_left_dense_is_refused():
    msg = _raises(_untied_head_left_dense, 2)
    assert "lm_head.weight is tied to model.embed_tokens.weight, which the plan splits" in msg


class _WidthReader(torch.nn.Module):
    """Attention that derives its scale from an attribute parallelize cannot know about."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.num_heads, self.width = heads, d
        self.q_proj, self.k_proj = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.v_proj, self.o_proj = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.num_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scale = (self.width // self.num_heads) ** -0.5  # width is not divided: scale changes
        y = torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _width_reader(extra) -> float:
    torch.manual_seed(0)
    model = parallelize(
        _WidthReader(),
        {"[qkv]_proj": "column", "o_proj": "row"},
        group=None,
        example_inputs=torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)),
        heads=extra,
    )
    return model.fastpar_plan.output_rel_diff


def test_the_output_check_catches_what_the_static_checks_cannot():
    msg = _raises(_width_reader, 2, None)
    assert "the parallel model's output differs from the dense model's" in msg
    assert "pass heads=" in msg
    assert run_ranks(_width_reader, 2, {"": ["width"]})[0] < 1e-5  # declared: exact


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
    ids, _ = _batch("gpt2", 0)
    logits_d, logits_64 = (m(input_ids=ids).logits for m in (dense, dense64))
    agree(par(input_ids=ids).logits, logits_d, logits_64, "logits", length=_length("gpt2"))
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


def test_no_builtin_plan_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no built-in plan for Sequential .*built-in families: "):
        parallelize(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match="sequence_parallel is not supported by parallelize"):
        parallelize(build("llama"), {"lm_head": ("column", {"sequence_parallel": True})})
    with pytest.raises(ValueError, match="pass group= to parallelize, not in the plan"):
        parallelize(build("llama"), {"lm_head": ("column", {"group": None})})
    with pytest.raises(ValueError, match="style 'per_head' takes no keyword arguments"):
        parallelize(build("qwen3"), {"*.q_norm": ("per_head", {"x": 1})})


def _generate(family: str) -> list:
    dense = build(family)
    par = parallelize(copy.deepcopy(dense), mesh=make_mesh(tp=2))
    ids, _ = _batch(family, 0, rows=2, seq=5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want, got = dense.generate(ids, **kw), par.generate(ids, **kw)  # KV cache with local heads
    assert torch.equal(got, want), (got, want)
    return got.tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_on_a_tensor_parallel_model(family):
    out = run_ranks(_generate, 2, family)
    assert out[0] == out[1] and len(out[0][0]) == 11


def _readme_plan() -> dict:
    """The plan of docs/hf.md's "or a plan of your own" snippet, as written there."""
    import ast
    import pathlib

    lines = (pathlib.Path(__file__).parents[1] / "docs" / "hf.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if "# or a plan of your own" in line)
    last = next(i for i in range(first, len(lines)) if lines[i].strip() == "},")
    body = [line.split("  #")[0] for line in lines[first : last + 1]]
    return ast.literal_eval("\n".join(body).strip().rstrip(","))


def _readme_snippet(plan: dict) -> list:
    dense = build("qwen3")
    par = parallelize(copy.deepcopy(dense), plan, make_mesh(tp=2))
    ids, _ = _batch("qwen3", 0)
    n = _length("qwen3")
    runs = _dense_runs("qwen3", dense, ids, ids)
    loss_p = par(input_ids=ids, labels=ids).loss
    _agree_runs(loss_p, runs, lambda r: r[1], "loss", n)
    loss_p.backward()
    for name, p in par.named_parameters():
        _agree_runs(
            p.grad,
            runs,
            lambda r, k=name: r[2][k],
            f"grad of {name}",
            n,
            lambda t, p=p: _expected_grad(p, t),
        )
    return par.fastpar_plan.found_by_probe


def test_the_readme_plan_is_correct_for_qwen3():
    plan = _readme_plan()
    assert plan["model.layers.*.self_attn.[qkv]_proj"] == "column"
    assert run_ranks(_readme_snippet, 2, plan)[0] == []  # every per-head norm was declared


class _SplitScale(torch.nn.Module):
    """A learnable scale over a column output's features (not the layer's own bias)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 12))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * self.scale)


def _split_scale() -> None:
    parallelize(_SplitScale(), {"up": "column", "down": "row"})


def test_a_parameter_on_the_split_features_is_refused():
    msg = _raises(_split_scale, 2)
    assert "parameter 'scale' acts elementwise on the split features of 'up'" in msg
    assert "make it 'up''s own bias, or gather that output" in msg


def _nano_without_width() -> None:
    from _models import NANO_PLAN, NanoGPT

    parallelize(NanoGPT(), NANO_PLAN)  # nanoGPT splits with n_embd: heads={"*.attn": ["n_embd"]}


def test_a_model_that_breaks_after_the_swap_is_refused_inside_parallelize():
    msg = _raises(_nano_without_width, 2)
    assert "the parallel NanoGPT failed on the probe input where the dense one ran" in msg


def _save_pretrained(tmp: str) -> str:
    from fastpar.nn.guard import ShardedSaveError

    model = parallelize(build("llama"), mesh=make_mesh(tp=2))
    with pytest.raises(ShardedSaveError) as info:
        model.save_pretrained(tmp)
    return str(info.value)


def test_save_pretrained_on_a_parallelized_model_refuses(tmp_path):
    msg = run_ranks(_save_pretrained, 2, str(tmp_path / "out"))[0]
    assert "Save it with fastpar.checkpoint.save_hf(model, out_dir, mesh=mesh)" in msg
    assert not (tmp_path / "out").exists()  # nothing written
