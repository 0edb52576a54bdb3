"""parallelize() on Hugging Face models: every plan it must refuse (before the model is used,
or on its probe input), each with a message naming the value and the fix; and
``save_pretrained`` of a parallelized model refused. The plans it accepts:
tests/test_nn_parallelize_hf.py."""

from __future__ import annotations

import re

import pytest
import torch
from _hf import build
from _mesh import make_mesh

import fastpar
from fastpar import parallelize
from fastpar.testing import RankError, run_ranks


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
