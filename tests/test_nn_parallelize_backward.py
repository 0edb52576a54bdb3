"""parallelize's check runs the backward too (docs/hf.md, "The check").

Two defects that the output alone cannot show: an activation shared by every local head with no
copy-to-region (MLA's rope key: the forward is exact, every gradient upstream of it is this
rank's heads' share only), and per-head modules paired with the heads by position (StableLM's
``qk_layernorm`` keeps one LayerNorm per head in a ModuleList: after the head split each rank
would use the first rank's norms). The backward check refuses the first, naming the parameter
and the cause; the second is fixed (each rank keeps its heads' norms) and exact, logits and
every gradient and after 3 AdamW steps; with ``check="forward"`` both defects pass silently.
Then the refusals of the parallel forward name the module, the cause and the fix.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _hf import WIDTH, stablelm, transformers
from _mesh import make_mesh
from torch import nn

from fastpar import parallelize
from fastpar.nn import param_layout
from fastpar.parity import reduction_length
from fastpar.testing import RankError, run_ranks
from fastpar.tolerance import compare, train_references

VOCAB = 61


class _SharedKey(nn.Module):
    """Attention whose keys end in one part shared by every head (MLA's rope key): ``k_rot``
    is computed once and broadcast into each head."""

    def __init__(self, d=16, heads=4, hd=4, rd=2):
        super().__init__()
        self.num_heads, self.hd, self.rd = heads, hd, rd
        self.norm = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, heads * (hd + rd))
        self.k_proj = nn.Linear(d, heads * hd)
        self.v_proj = nn.Linear(d, heads * hd)
        self.k_rot = nn.Linear(d, rd)
        self.o_proj = nn.Linear(heads * hd, d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(b, t, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.num_heads, -1).transpose(1, 2)
        rot = self.k_rot(h)[:, None].expand(b, self.num_heads, t, self.rd)  # no copy region
        k = torch.cat([k, rot], -1)
        y = torch.softmax(q @ k.transpose(-1, -2) / (self.hd + self.rd) ** 0.5, -1) @ v
        return x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


_SHARED_PLAN = {"[qkv]_proj": "column", "o_proj": "row", "k_rot": "replicate"}


def _x() -> torch.Tensor:
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))


def _shared_key(check, auto: bool = False) -> float:
    """Parallelize the shared-key attention; returns the worst gradient error against the
    dense model's on the check's input, relative to the gradient's size. Without ``auto`` the
    probe's shared-key region is undone (the defect as it was)."""
    import sys

    module = sys.modules["fastpar.nn.parallelize"]  # the name is shadowed by the function
    keep = module._shared_keys
    if not auto:
        module._shared_keys = lambda *args, **kwargs: None
    torch.manual_seed(0)
    dense = _SharedKey()
    par = _SharedKey()
    par.load_state_dict(dense.state_dict())
    try:
        parallelize(par, _SHARED_PLAN, group=None, example_inputs=_x(), check=check)
    finally:
        module._shared_keys = keep
    if auto:
        assert par.fastpar_plan.shared_key == ["k_rot"], par.fastpar_plan.shared_key
    for m in (dense, par):
        (
            m(_x()) * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
        ).sum().backward()
    worst = 0.0
    for name in ("norm.weight", "k_rot.weight"):  # replicated: compared whole
        d, p = dict(dense.named_parameters())[name].grad, dict(par.named_parameters())[name].grad
        worst = max(worst, float((p - d).abs().max() / d.abs().max()))
    return worst


def test_backward_check_refuses_a_shared_activation_without_copy_region():
    with pytest.raises(RankError) as info:
        run_ranks(_shared_key, 2, True)
    msg = str(info.value)
    assert "the gradient of 'k_rot.weight'" in msg  # the module planned whole that feeds every head
    assert "copy-to-region" in msg and "shared by every local head" in msg
    assert "check='forward'" in msg


def test_the_probe_gives_a_shared_key_its_region():
    # the key every local head reads gets its copy-to-region from the probe: exact
    assert max(run_ranks(_shared_key, 2, True, True)) < 1e-5


def _mla_user_plan() -> tuple:
    """DeepSeek-V3 (MLA) under a user's attention plan that leaves kv_a_proj_with_mqa
    'replicate': the probe finds its rope-key features read by every local head."""
    import fnmatch

    from _hf import build

    from fastpar.nn.plans import builtin_plan

    model = build("deepseek_v3")
    names = [n for n, _ in model.named_modules()]
    plan = {
        k: "replicate" if k.endswith("kv_a_proj_with_mqa") else v
        for k, v in builtin_plan(model).items()
        if "self_attn" in k and any(fnmatch.fnmatchcase(n, k) for n in names)
    }
    assert "replicate" in plan.values()
    parallelize(model, plan, make_mesh(tp=2))
    record = model.fastpar_plan
    attn = model.model.layers[0].self_attn
    return record.checked, record.shared_key, attn.kv_a_proj_with_mqa.features


@pytest.mark.slow  # about 10 s: DeepSeek-V3 checked at TP 2
def test_mla_rope_key_left_replicate_gets_its_region():
    (checked, shared, features), _ = run_ranks(_mla_user_plan, 2)
    assert checked == "backward"  # and the check passed: every gradient exact
    assert shared == [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa" for i in (0, 1)]
    assert features == _qk_rope_head_dim()


def _qk_rope_head_dim() -> int:
    from _hf import build

    return build("deepseek_v3").config.qk_rope_head_dim


_USER_PLAN = {
    "*.self_attn.[qkv]_proj": "column",
    "*.self_attn.o_proj": "row",
    "*.mlp.gate_proj": "column",
    "*.mlp.up_proj": "column",
    "*.mlp.down_proj": "row",
}


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(50 + step))


def _unsliced():
    """parallelize without the per-head list slicing: the defect as it was."""
    import sys

    module = sys.modules["fastpar.nn.parallelize"]  # the name is shadowed by the function
    return module, module.slice_head_lists


def _stablelm_mixup(check) -> float:
    """StableLM under the per-head mix-up (the slicing undone); returns the worst gradient
    error of a q_layernorm norm against the dense model's, relative to its size."""
    module, keep = _unsliced()
    module.slice_head_lists = lambda *args, **kwargs: []
    try:
        dense, par = stablelm(VOCAB), stablelm(VOCAB)
        parallelize(par, _USER_PLAN, make_mesh(tp=2), check=check)
    finally:
        module.slice_head_lists = keep
    for m in (dense, par):
        m(_ids(0)).logits.square().sum().backward()
    worst = 0.0
    named = dict(par.named_parameters())
    for name, p in dense.named_parameters():
        if "q_layernorm" in name and named[name].grad is not None:
            worst = max(worst, float((named[name].grad - p.grad).abs().max() / p.grad.abs().max()))
    return worst


def test_backward_check_refuses_per_head_modules_paired_by_position():
    with pytest.raises(RankError) as info:
        run_ranks(_stablelm_mixup, 2, True)
    msg = str(info.value)
    assert "layernorm.norms." in msg and "per-head" in msg and "paired" in msg


def test_without_the_backward_check_both_defects_pass_silently():
    # check="forward": the output agrees, so both plans are accepted, and yet the gradients
    # are wrong by far more than rounding
    assert min(run_ranks(_shared_key, 2, "forward")) > 1e-2
    assert min(run_ranks(_stablelm_mixup, 2, "forward")) > 1e-2


def _stablelm_train(steps: int = 3) -> list:
    mesh = make_mesh(tp=2)

    def loss(model, step, dtype):
        ids = _ids(step)
        logits = model(ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    length = reduction_length(stablelm(VOCAB), _ids(0))

    def logits(model, dtype):
        return model(_ids(0)).logits.detach()

    refs = train_references(
        partial(stablelm, VOCAB),
        loss,
        steps,
        length=length,
        lr=1e-2,
        weight_decay=0.01,
        before=logits,
    )
    par = parallelize(stablelm(VOCAB), _USER_PLAN, mesh)
    record = par.fastpar_plan
    rank = dist.get_rank(mesh.tp_group)
    attn = par.model.layers[0].self_attn
    # each rank keeps its heads' norms, under their dense names
    assert [n for n, _ in attn.q_layernorm.norms.named_children()] == [
        str(2 * rank),
        str(2 * rank + 1),
    ]
    assert attn.q_layernorm.num_heads == 2
    assert record.checked == "backward" and record.head_sliced and record.grad_reduced == []
    named = dict(par.named_parameters())
    refs.local = lambda full, name: _local(full, named[name])
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    checked = 0
    for step in range(steps):
        ids = _ids(step)
        logits = par(ids).logits
        value = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        value.backward()
        if step == 0:  # the logits and every gradient of the fresh model
            runs = [r.before for r in (refs.single, refs.twin, refs.exact)]
            _ok(compare(logits.detach(), runs[:2], runs[2], length=length, what="logits"))
            for name, p in named.items():
                _ok(refs.grad(step, name, p.grad))
                checked += 1
        _ok(refs.loss(step, float(value)))
        opt.step()
    for name, p in named.items():  # every parameter after the steps (AdamW's slack)
        _ok(refs.param(name, p.detach()))
    # the logits after the steps, when the norms differ
    with torch.no_grad():
        final = par(_ids(9)).logits
    return [checked, final]


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from _parity import local_slice

    return full if param_layout(p) is None else local_slice(full, p)


def _ok(comparison) -> None:
    assert comparison.ok, str(comparison)


def test_stablelm_qk_layernorm_is_exact_after_the_head_lists_are_sliced():
    results = run_ranks(_stablelm_train, 2)
    assert results[0][0] > 0
    # the ranks end with the same logits (their replicated weights stayed equal)
    assert torch.equal(results[0][1], results[1][1])


def _forward_fails() -> None:
    class Reader(_SharedKey):
        def forward(self, x):
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, 4, self.hd + self.rd)  # widths the split cannot see
            return self.o_proj(q[..., : self.hd].reshape(b, t, -1)) + self.k_rot(x).sum()

    torch.manual_seed(0)
    parallelize(Reader(), _SHARED_PLAN, group=None, example_inputs=_x())


def test_a_failing_parallel_forward_names_the_module_and_the_fix():
    with pytest.raises(RankError) as info:
        run_ranks(_forward_fails, 2)
    msg = str(info.value)
    assert "failed on the probe input where the dense one ran, in module '<model>'" in msg
    assert "reshapes a split activation" in msg and "pass heads=" in msg
    assert "whole (drop its projections from the plan)" in msg


def _hf(family: str, **overrides):
    base = dict(WIDTH, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2)
    base["max_position_embeddings"] = 64
    cls = {"phi3": "Phi3Config", "olmo2": "Olmo2Config", "falcon": "FalconConfig"}[family]
    if family == "falcon":  # per-head interleaved q|k|v, its own num_kv_heads attribute
        base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
        base.update(new_decoder_architecture=False, multi_query=False)
    if family == "phi3":
        base["pad_token_id"] = 0  # its default lies outside this small vocabulary
    cfg = getattr(transformers, cls)(**{**base, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


_FAMILY_PLANS = {
    "phi3": {
        "*.self_attn.qkv_proj": "column",
        "*.self_attn.o_proj": "row",
        "*.mlp.gate_up_proj": "column",
        "*.mlp.down_proj": "row",
    },
    "olmo2": _USER_PLAN,
    "falcon": {
        "*.self_attention.query_key_value": "column",
        "*.self_attention.dense": "row",
        "*.mlp.dense_h_to_4h": "column",
        "*.mlp.dense_4h_to_h": "row",
    },
}


def _family(family: str, heads=None) -> str | None:
    model = _hf(family)
    parallelize(model, _FAMILY_PLANS[family], make_mesh(tp=2), heads=heads)
    return model.fastpar_plan.checked


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        # a fused q|k|v of unequal blocks (GQA): a plain column split mixes them
        (
            "phi3",
            [
                "in module 'model.layers.0.self_attn' (Phi3Attention)",
                "is a fused projection",
                "('column', {'fused': k})",
                "leave 'model.layers.0.self_attn' whole",
            ],
        ),
        # a norm over every head's features at once: no exact split
        (
            "olmo2",
            [
                "in module 'model.layers.0.self_attn.q_norm' (Olmo2RMSNorm)",
                "applies its 'weight' of width 32",
                "cannot be split exactly",
                "leave 'model.layers.0.self_attn' whole",
            ],
        ),
    ],
)
def test_refusals_name_the_module_the_cause_and_the_fix(family, expected):
    with pytest.raises(RankError) as info:
        run_ranks(_family, 2, family)
    msg = str(info.value)
    for part in expected:
        assert part in msg, (part, msg[:1500])


def test_falcon_is_exact_or_refused_naming_its_head_count():
    """Falcon's attention reads its key/value head count under a name parallelize does not know
    in some transformers versions (5.24: refused, naming heads=), not in others (5.25: exact);
    either way the backward check decides, never a silent mix-up."""
    try:
        assert run_ranks(_family, 2, "falcon") == ["backward", "backward"]
    except RankError as exc:
        msg = str(exc)
        assert "in module 'transformer.h.0.self_attention' (FalconAttention)" in msg, msg[:1500]
        assert "pass heads={'*.self_attention': ['num_kv_heads']}" in msg, msg[:1500]


def test_the_fix_a_refusal_names_is_then_checked_forward_and_backward():
    assert run_ranks(_family, 2, "falcon", {"*.self_attention": ["num_kv_heads"]}) == [
        "backward",
        "backward",
    ]


def _weights_kept() -> int:
    """parallelize perturbs the parameters it checks and puts them back exactly."""
    from fastpar.checkpoint.state import localize

    dense = stablelm(VOCAB)
    par = parallelize(stablelm(VOCAB), _USER_PLAN, make_mesh(tp=2))
    full = dict(dense.named_parameters())
    count = 0
    for name, p in par.named_parameters():
        assert torch.equal(p.detach(), localize(full[name].detach(), p)), name  # bit for bit
        assert p.grad is None, name
        count += 1
    return count


def test_the_check_leaves_the_weights_exactly_as_they_were():
    assert min(run_ranks(_weights_kept, 2)) > 0


def test_check_values():
    with pytest.raises(ValueError, match="check must be one of"):
        parallelize(_SharedKey(), _SHARED_PLAN, group=None, check="both")
