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
import torch.distributed as dist
import torch.nn.functional as F
from _hf import build, exact
from _mesh import make_mesh
from _parity import exact_copy, local_slice
from test_moe_hf_blocks import _block, _tokens

from fastpar import parallelize
from fastpar.checkpoint import load_hf, save_hf
from fastpar.moe import update_expert_bias
from fastpar.moe.hf_block import HFMoEBlock
from fastpar.nn.marks import expert_layout, param_layout
from fastpar.parallel import DistributedDataParallel
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree, nudge

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


def _logits_and_loss(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the model's ``labels=ids`` loss written out in the logits' dtype (HF's
    casts the logits to fp32, which would make the float64 reference only as exact as fp32)."""
    logits = model(input_ids=ids).logits
    return logits, F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return _logits_and_loss(model, ids)[1]


def _agree(actual, single, exact, what: str, length: int, p: torch.Tensor | None = None):
    """The rule on ``actual`` against ``single`` (one run or several) and ``exact``, both cut
    to this rank's part of parameter ``p`` when given."""
    if p is not None:
        single = [_local(t, p) for t in single] if isinstance(single, list) else _local(single, p)
        exact = _local(exact, p)
    return assert_agree(actual, single, exact, length=length, what=what)


def _grads_and_training(family: str, tmp: str):
    mesh = make_mesh(tp=2, ep=2, dp=2)  # the experts split over both dp ranks
    dense = _model(family)
    dense64 = exact(dense)
    model = parallelize(copy.deepcopy(dense), mesh=mesh)
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert blocks and all(b.moe.tp_layout == "expert_tp" and b.moe.ep == 2 for b in blocks)
    ids = _batch(0)
    n = reduction_length(dense, ids)  # the longest sum: the vocabulary here
    halves = (slice(0, 2), slice(2, 4))
    half = halves[mesh.dp_rank]
    # one step on this replica's half: the dense model on the same half, except that an
    # expert's gradient sums the tokens of every EP rank (both halves)
    out = model(input_ids=ids[half], labels=ids[half])
    out.loss.backward()
    runs = {}  # per precision: (this half's logits, loss, gradients of each half)
    for key, base in (("fp32", dense), ("fp64", dense64)):
        grads = []
        for h in halves:
            d = copy.deepcopy(base)
            logits, loss = _logits_and_loss(d, ids[h])
            loss.backward()
            if h == half:
                mine = (logits.detach(), loss.detach())
            grads.append(dict(d.named_parameters()))
        runs[key] = (*mine, grads)
    (logits32, loss32, grads32), (logits64, loss64, grads64) = runs["fp32"], runs["fp64"]
    _agree(out.logits, logits32, logits64, "logits", n)
    _agree(out.loss, loss32, loss64, "loss", n)
    names = set()
    for name, p in model.named_parameters():
        names.add(name)

        def want(grads, name=name, p=p):
            if expert_layout(p) is not None:
                return sum(g[name].grad for g in grads)
            return grads[mesh.dp_rank][name].grad

        _agree(p.grad, want(grads32), want(grads64), f"grad of {name}", n, p)
    assert names == {n for n, _ in dense.named_parameters()}  # HF's names, all of them
    # training: DDP over the replicas equals the dense model on the whole batch (SGD: the
    # fp32 run, its twin one rounding away and the float64 run)
    model = parallelize(copy.deepcopy(dense), mesh=mesh)
    ddp = DistributedDataParallel(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    refs = [copy.deepcopy(dense), copy.deepcopy(dense), copy.deepcopy(dense64)]
    nudge(refs[1], seed=1)
    ref_opts = [torch.optim.SGD(r.parameters(), lr=0.5) for r in refs]
    for step in range(3):
        ids = _batch(step + 1)
        ddp(input_ids=ids[half], labels=ids[half]).loss.backward()
        opt.step()
        opt.zero_grad()
        for ref, ref_opt in zip(refs, ref_opts, strict=True):
            # the replicas' mean loss: each half's loss / 2 (an expert sees both halves)
            (sum(_lm_loss(ref, ids[h]) for h in halves) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    trained = [{n: t.detach().clone() for n, t in r.named_parameters()} for r in refs]
    for name, p in model.named_parameters():
        _agree(
            p.detach(),
            [trained[0][name], trained[1][name]],
            trained[2][name],
            f"after 3 steps {name}",
            n,
            p,
        )
    # the sharded model saves as the HF model, and loads back: a round trip, bit for bit
    save_hf(model, tmp, mesh=mesh)
    fresh = parallelize(_model(family), mesh=mesh)
    load_hf(fresh, tmp)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), f"load_hf: {name}"
    converted = [n for n, _ in model.named_parameters() if n.endswith("gate_up_proj")]
    return converted, trained, n


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_model_at_tp2_ep2_equals_dense_and_saves_as_hf(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    names, trained, n = run_ranks(_grads_and_training, 4, family, str(tmp_path), timeout=240)[0]
    assert names, "no MoE block was converted"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float()
    got = dict(loaded.named_parameters())
    single, twin, exact = trained
    assert set(got) == set(single)
    for name, t in single.items():  # what HF loads is the dense model trained alike
        assert_agree(got[name], [t, twin[name]], exact[name], length=n, what=f"loaded {name}")


def _deepseek(tp: int):
    mesh = make_mesh(tp=tp)
    block = _block("deepseek_v3")
    block64 = exact_copy(block)
    ours = HFMoEBlock(copy.deepcopy(block), mesh=mesh)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in block.named_parameters()}
    assert "gate.e_score_correction_bias" in ours.state_dict()
    x, g = _tokens(0, 13)
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
    _agree(y, yr.detach(), y64.detach(), "output", n)
    _agree(xo.grad, xr.grad, x64.grad, "input grad", n)
    ref, ref64 = dict(block.named_parameters()), dict(block64.named_parameters())
    for name, p in ours.named_parameters():
        _agree(p.grad, ref[name].grad, ref64[name].grad, f"grad of {name}", n, p)
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
        model = parallelize(_model("mixtral"), mesh=make_mesh(ep=2))
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
