"""``fastpar.parallelize`` on Hugging Face MoE models: the built-in plans turn every MoE block
into ``HFMoEBlock`` (fastpar's MoE under the block's own names, experts split over TP and over
the mesh's EP group). Against the dense HF model: logits, loss and every gradient at TP 2 ×
EP 2; training under DDP; ``save_hf`` writes a directory HF loads as the same model and
``load_hf`` reads it back into the sharded one; a DeepSeek-V3 block at TP 2 (shared experts,
expert bias updated through the gate) equals HF's.

"Equals" is ``fastpar.tolerance``'s rule (docs/tolerances.md): fastpar's MoE sums its experts'
products in other kernels and orders (per-rank parts, all-reduces, all-to-alls), so each output
and gradient is judged against the HF model's fp32 run and its float64 run (``.double()``, its
loss a float64 cross-entropy), the SGD-trained parameters against the fp32 run, its one-ulp
twin (``nudge``) and the float64 run. ``load_hf`` reads back what ``save_hf`` wrote: bit for
bit."""

from __future__ import annotations

import copy

import pytest
import torch
from _hf import build
from _mesh import make_mesh
from _moe_hf import check_saved_as_hf, ep_agree, hf_block, tokens
from _parity import exact_copy

from fastpar import parallelize
from fastpar.moe import update_expert_bias
from fastpar.moe.hf_block import HFMoEBlock
from fastpar.testing import run_ranks

pytest.importorskip("transformers", reason="the hf extra (pip install fastpar[hf])")
MOE_FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_model_at_tp2_ep2_equals_dense_and_saves_as_hf(family, tmp_path):
    check_saved_as_hf(family, tmp_path)


def _deepseek(tp: int):
    mesh = make_mesh(tp=tp)
    block = hf_block("deepseek_v3")
    block64 = exact_copy(block)
    ours = HFMoEBlock(copy.deepcopy(block), mesh=mesh)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in block.named_parameters()}
    assert "gate.e_score_correction_bias" in ours.state_dict()
    x, g = tokens(0, 13)
    n = max(x.shape[1], *(max(p.shape) for p in block.parameters()))  # tokens, widest dim
    xr, xo, x64 = (
        x.clone().requires_grad_(),
        x.clone().requires_grad_(),
        x.double().requires_grad_(),
    )
    yr = block(xr)
    (yr * g).sum().backward()
    y64 = block64(x64)
    (y64 * g.double()).sum().backward()
    y = ours(xo)
    (y * g).sum().backward()
    ep_agree(y, yr.detach(), y64.detach(), "output", n)
    ep_agree(xo.grad, xr.grad, x64.grad, "input grad", n)
    ref, ref64 = dict(block.named_parameters()), dict(block64.named_parameters())
    for name, p in ours.named_parameters():
        ep_agree(p.grad, ref[name].grad, ref64[name].grad, f"grad of {name}", n, p)
    before = ours.gate.e_score_correction_bias.clone()
    assert update_expert_bias(ours) == 1  # found through the gate; counts of its forward
    assert not torch.equal(before, ours.gate.e_score_correction_bias)
    return float((ours.gate.e_score_correction_bias - before).abs().max())


def test_deepseek_v3_block_at_tp2_equals_hf_and_updates_its_bias():
    hf_block("deepseek_v3")  # skips when this transformers lacks the block
    steps = run_ranks(_deepseek, 2, 2)
    assert steps[0] == pytest.approx(1e-3, rel=1e-5) and steps[0] == steps[1]


def _router_logits_refused() -> str:
    model = build("mixtral", output_router_logits=True)
    try:
        parallelize(model, mesh=make_mesh(tp=2))
    except ValueError as e:
        return str(e)
    return ""


def test_hf_router_aux_loss_is_refused_rather_than_lost():
    """HF's own router aux loss reads logits off its router modules, which converted blocks do
    not have: parallelize refuses instead of silently dropping that loss term."""
    msg = run_ranks(_router_logits_refused, 2)[0]
    assert "output_router_logits=True" in msg and "output_router_logits=False" in msg


class _DoubledGrad(torch.autograd.Function):
    """Identity forward, twice the gradient backward: a defect the output cannot show."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def _experts_checked(doubled: bool) -> tuple:
    """Mixtral at EP 2: the converted experts (this rank's half, dim 0) are compared by the
    backward check; with ``doubled`` their gradients are twice the true ones."""
    from fastpar.moe import experts

    keep = experts.from_hf
    if doubled:

        def from_hf(gate_up, down):
            return keep(_DoubledGrad.apply(gate_up), down)

        experts.from_hf = from_hf
    try:
        model = parallelize(build("mixtral"), mesh=make_mesh(ep=2))
    except ValueError as exc:
        return "refused", str(exc)
    finally:
        experts.from_hf = keep
    return model.fastpar_plan.checked, model.fastpar_plan.unchecked


@pytest.mark.slow  # 8-26 s (2 cores, as loaded): two parallelizes at EP 2
def test_backward_check_compares_the_converted_experts():
    # at EP 2 every expert parameter is compared (none left unchecked), and exact
    assert run_ranks(_experts_checked, 2, False) == [("backward", [])] * 2
    # a wrong expert gradient (doubled, the forward untouched) is refused, naming it
    verdict, msg = run_ranks(_experts_checked, 2, True)[0]
    assert verdict == "refused" and "experts.gate_up_proj" in msg, msg[:1000]
