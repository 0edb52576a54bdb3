"""Hugging Face MoE blocks loaded into ``MoE`` through ``fastpar.moe.hf`` (fp32, random init;
the expected values come from the HF modules themselves):

- Mixtral, Qwen3-MoE (``norm_topk_prob`` on and off), Qwen2-MoE (gated shared expert) and a
  DeepSeek-V3 block (sigmoid, group-limited top-k, nonzero ``e_score_correction_bias``,
  ``routed_scaling_factor``, shared experts) at EP 1 and EP 2: output and input gradient on each
  rank's tokens against HF on the same tokens; router, expert and shared-expert gradients against
  HF's on the whole batch (experts: this rank's slice; dense parameters: summed over the ranks);
- the export ``moe_to_hf_state_dict(moe_from_hf(block))`` equals the block's state dict
  (gathered over EP, and the per-rank slice with ``gather=False``);
- bf16 blocks (rounding only) and DeepSeek-V3 without shared experts;
- refusals of what MoE cannot compute exactly, and of exports that would drop parameters.

fastpar against HF is judged by ``fastpar.tolerance``'s rule (docs/tolerances.md): fastpar's
error against HF's block run in float64 at most 4 x the error of HF's own run in the working
precision — it and its twin, the block with every weight one rounding away (``nudge``) — plus
a floor. The twin matters here: HF's float64 block still routes in fp32 (Mixtral and Qwen cast
the router logits to fp32, DeepSeek-V3's gate runs in fp32), so the router's gradient of HF's
fp32 run and of its float64 run share those roundings; the twin's do not. Routing is discrete:
every run must choose the same experts (checked), so a near-tie fails as that.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh
from _moe_hf import BLOCKS, FFN, H, hf_block, tokens
from _parity import agree, exact_copy

from fastpar.mesh import placement
from fastpar.moe.hf import moe_from_hf, moe_to_hf_state_dict
from fastpar.testing import nudge, run_ranks

COUNTS = (11, 14)  # tokens of EP rank 0, 1 (dropless: uneven)
LENGTH = max(sum(COUNTS), 2 * FFN * 2)  # the tokens a weight gradient sums over, the widths


def _hf_grads(block, family: str) -> dict[str, torch.Tensor]:
    """HF's gradients in fastpar's names and layout (written out here, not taken from hf.py)."""
    g = {
        "router.weight": block.gate.weight.grad,
        "w1": block.experts.gate_up_proj.grad.transpose(1, 2),
        "w2": block.experts.down_proj.grad.transpose(1, 2),
    }
    mlp = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    if mlp is not None:
        g["shared.w1"] = torch.cat([mlp.gate_proj.weight.grad, mlp.up_proj.weight.grad]).t()
        g["shared.w2"] = mlp.down_proj.weight.grad.t()
    if hasattr(block, "shared_expert_gate"):
        g["shared_gate.weight"] = block.shared_expert_gate.weight.grad
    return g


def _runs(block, x, g) -> list[tuple]:
    """HF's block on ``x`` [1, T, H] with output gradient ``g``, run three ways: in its own
    precision, as its twin (``nudge``) and in float64 (the exact math); per run (output, input
    grad, gradients in fastpar's names and layout, the experts each token chose)."""
    twin = copy.deepcopy(block)
    nudge(twin, seed=1)
    out = []
    for b in (block, twin, exact_copy(block)):
        dtype = b.experts.down_proj.dtype
        xb = x.to(dtype, copy=True).requires_grad_()
        y = b(xb)
        (y * g.to(dtype)).sum().backward()
        with torch.no_grad():
            chosen = b.gate(xb.detach())[2].sort(-1).values
        out.append((y.detach(), xb.grad, _hf_grads(b, ""), chosen))
    assert all(torch.equal(r[3], out[0][3]) for r in out), "HF's runs choose other experts"
    return out


def _agree(got, runs, pick, what):
    """``got`` against ``pick(run)`` of the runs of ``_runs`` by the rule."""
    *singles, exact = (pick(r) for r in runs)
    agree(got, singles, exact, what, length=LENGTH)


def _parity(family: str, ep: int) -> None:
    rank = dist.get_rank() if ep > 1 else 0
    block = hf_block(family)
    moe = moe_from_hf(block, mesh=make_mesh(ep=ep) if ep > 1 else None)
    counts = COUNTS[:ep] if ep > 1 else (sum(COUNTS),)
    data = [tokens(r, t) for r, t in enumerate(counts)]
    # HF on the whole batch (every rank's tokens): fp32, its twin, float64
    x_all = torch.cat([x for x, _ in data], dim=1)
    runs = _runs(block, x_all, torch.cat([g for _, g in data], dim=1))
    # fastpar on this rank's tokens
    x, g = data[rank]
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * g).sum().backward()
    rows = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    _agree(y, runs, lambda r: r[0][:, rows], "output")
    _agree(x.grad, runs, lambda r: r[1][:, rows], "input grad")
    grads = {n: p.grad for n, p in moe.named_parameters()}
    assert set(grads) == set(runs[0][2]), (sorted(grads), sorted(runs[0][2]))
    lo, n = rank * moe.num_local, moe.num_local
    for name, got in grads.items():
        p = dict(moe.named_parameters())[name]
        if placement.is_expert(p):  # already every rank's tokens
            _agree(got, runs, lambda r, k=name: r[2][k][lo : lo + n], f"grad {name}")
        else:  # dense: this rank's tokens; the DP reduction sums the ranks
            if ep > 1:
                got = got.clone()
                dist.all_reduce(got)
            _agree(got, runs, lambda r, k=name: r[2][k], f"grad {name}")
    # the export: HF's names and values (gathered over EP, or this rank's slice)
    sd = block.state_dict()
    out = moe_to_hf_state_dict(moe)
    assert sorted(out) == sorted(sd)
    for k, v in sd.items():  # copies of the same numbers: bit for bit
        assert out[k].shape == v.shape and out[k].dtype == v.dtype, k
        assert torch.equal(out[k], v), k
    if ep > 1:
        mine = moe_to_hf_state_dict(moe, gather=False, prefix="mlp.")
        for k, v in sd.items():
            expected = v[lo : lo + n] if k.startswith("experts.") else v
            assert torch.equal(mine["mlp." + k], expected), k


@pytest.mark.parametrize("family", list(BLOCKS))
def test_hf_block_parity_ep1(family):
    _parity(family, 1)


@pytest.mark.parametrize("family", list(BLOCKS))
def test_hf_block_parity_ep2(family):
    hf_block(family)  # skips here when transformers lacks the block
    run_ranks(_parity, 2, family, 2)


def test_deepseek_settings_and_bias_change_the_selection():
    """The DeepSeek-V3 block becomes sigmoid + bias + groups + scaling; its bias and its group
    limit each change HF's own choice of experts on these tokens (so both paths are tested)."""
    block = hf_block("deepseek_v3")
    moe = moe_from_hf(block)
    r = moe.router
    assert (r.score, r.num_groups, r.group_topk, r.scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert torch.equal(r.expert_bias, block.gate.e_score_correction_bias)
    assert moe.shared.ffn_hidden_size == 2 * FFN
    x = tokens(0, 25)[0]
    with torch.no_grad():
        ids = block.gate(x)[2].sort(-1).values
        block.gate.e_score_correction_bias.zero_()
        unbiased = block.gate(x)[2].sort(-1).values
        block.gate.topk_group = block.gate.num_group
        ungrouped = block.gate(x)[2].sort(-1).values
    assert not torch.equal(ids, unbiased)
    assert not torch.equal(unbiased, ungrouped)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_deepseek_without_shared_experts():
    """``n_shared_experts=0``: HF holds zero-width shared projections (adding zero); the layer
    has no shared expert, and the export gives back the zero-width tensors."""
    block = hf_block("deepseek_v3", n_shared_experts=0)
    moe = moe_from_hf(block)
    assert moe.shared is None
    x = tokens(0, 25)[0]
    runs = _runs(block, x, torch.zeros_like(x))
    with torch.no_grad():
        _agree(moe(x), runs, lambda r: r[0], "output")
    out = moe_to_hf_state_dict(moe)
    assert sorted(out) == sorted(block.state_dict())
    for k, v in block.state_dict().items():
        assert torch.equal(out[k], v), k


def test_export_refuses_a_layer_the_family_cannot_hold():
    moe = moe_from_hf(hf_block("qwen2_moe"))
    with pytest.raises(ValueError, match="a mixtral block has no shared experts; this layer has"):
        moe_to_hf_state_dict(moe, family="mixtral")
    with pytest.raises(ValueError, match="a deepseek_v3 block has no shared_gate"):
        moe_to_hf_state_dict(moe, family="deepseek_v3")
    assert "shared_expert_gate.weight" in moe_to_hf_state_dict(moe)


def test_conversion_draws_no_random_numbers_and_keeps_the_mode():
    block = hf_block("mixtral").eval()
    state = torch.get_rng_state()
    moe = moe_from_hf(block)
    assert torch.equal(state, torch.get_rng_state())
    assert not moe.training and moe.router.capacity_factor is None
    assert moe_from_hf(block, aux_loss="micro_batch").router.aux_loss == "micro_batch"


def test_refuses_what_moe_cannot_compute():
    with pytest.raises(ValueError, match=r"router_jitter_noise=0\.1 is not supported"):
        moe_from_hf(hf_block("mixtral", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="approximations such as gelu_new are refused"):
        moe_from_hf(hf_block("qwen3_moe", hidden_act="gelu_new"))
    with pytest.raises(ValueError, match="groups of at least 2"):
        moe_from_hf(hf_block("deepseek_v3", n_group=8, topk_group=4))
    with pytest.raises(ValueError, match="supports the Hugging Face blocks"):
        moe_from_hf(torch.nn.Linear(H, H))
    with pytest.raises(TypeError, match="does not take \\['capacity_factor'\\]"):
        moe_from_hf(hf_block("mixtral"), capacity_factor=1.25)


def _clear_tokens(block, t: int) -> torch.Tensor:
    """``t`` tokens [1, t, H] in bf16 whose k-th best router logit beats the next by 0.05 at
    least (float64): far above bf16's rounding of a logit (~2^-9 of it), so HF's bf16 gate and
    fastpar's fp32 router choose alike whatever the seed."""
    k = block.gate.top_k
    x = tokens(0, 8 * t)[0].bfloat16()
    logits = x[0].double() @ block.gate.weight.double().t()
    top = logits.topk(k + 1, dim=-1).values
    clear = (top[:, k - 1] - top[:, k]) > 0.05
    assert int(clear.sum()) >= t, "too few tokens with a clear routing margin"
    return x[:, clear][:, :t]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_bf16_block_agrees_by_the_rule_and_exports_exactly(family):
    """In bf16 the numbers differ by rounding only (this router computes in fp32, HF's Mixtral
    gate in bf16; DeepSeek's gate is fp32 in both): judged by the rule in bf16 against HF's
    block in float64; the export is exact. Mixtral's tokens have clear routing margins (HF's
    bf16 gate rounds its logits to 2^-9: a near-tie there would pick another expert)."""
    block = hf_block(family).to(torch.bfloat16)
    if family == "deepseek_v3":
        block.gate.float()  # as HF builds it: an fp32 router inside a bf16 model
    moe = moe_from_hf(block)
    assert moe.w1.dtype == torch.bfloat16 and moe.router.weight.dtype == torch.float32
    x = _clear_tokens(block, 25) if family == "mixtral" else tokens(0, 25)[0].bfloat16()
    runs = _runs(block, x, torch.zeros_like(x))
    with torch.no_grad():
        agree(
            moe(x),
            [r[0] for r in runs[:2]],
            runs[2][0],
            "output",
            length=LENGTH,
            dtype=torch.bfloat16,
        )
    out = moe_to_hf_state_dict(moe)
    for k, v in block.state_dict().items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_import_needs_no_transformers():
    import subprocess
    import sys

    code = "import sys, fastpar, fastpar.moe.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
