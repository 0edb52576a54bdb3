"""Hugging Face MoE blocks from their configs (random weights, nothing downloaded): the table of
families (``BLOCKS``: module, class, config class, config keywords), ``hf_block(family)``
drawn under seed 0 with a nonzero score bias where it has one, and each EP rank's ``tokens``; a whole HF MoE model parallelized at TP 2 x EP 2 against the
dense one (``tp2_ep2_run``, ``check_saved_as_hf``), judged part by part (``ep_agree``)."""

from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mesh import make_mesh
from _parity import local_slice

from fastpar import parallelize
from fastpar.checkpoint import load_hf, save_hf
from fastpar.moe.hf_block import HFMoEBlock
from fastpar.nn.marks import expert_layout, param_layout
from fastpar.parallel import DistributedDataParallel
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree, nudge

H, FFN = 8, 6

BLOCKS = {  # name: (module, class, config class, config kwargs)
    "mixtral": (
        "mixtral",
        "MixtralSparseMoeBlock",
        "MixtralConfig",
        dict(intermediate_size=FFN, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=FFN, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "qwen3_moe-raw": (
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=FFN, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeConfig",
        dict(
            moe_intermediate_size=FFN,
            num_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=5,
            norm_topk_prob=False,
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        "DeepseekV3MoE",
        "DeepseekV3Config",
        dict(
            moe_intermediate_size=FFN,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
}


def hf_block(family: str, **overrides):
    """The HF MoE block of ``family`` (hidden size ``H``, SiLU; ``overrides`` on its config),
    every weight drawn under seed 0 (HF leaves some at zero or uninitialised)."""
    transformers = pytest.importorskip("transformers")
    module, cls, cfg_cls, kw = BLOCKS[family]
    try:
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError:
        pytest.skip(f"this transformers has no {module}")
    if not hasattr(mod, cls):
        pytest.skip(f"this transformers has no {cls}")
    kw = {"hidden_size": H, "hidden_act": "silu", **kw, **overrides}
    cfg = getattr(transformers, cfg_cls)(**kw)
    made = getattr(mod, cls)(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF leaves the fused experts uninitialised and routers at zero
        for p in made.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        bias = getattr(made.gate, "e_score_correction_bias", None)
        if bias is not None:  # nonzero, of the scores' size: it changes selections
            bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    return made


def tokens(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EP rank ``rank``'s ``t`` tokens [1, t, H], skewed towards some experts, and an output
    gradient."""
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(1, t, H, generator=gen)
    x[:, : t // 2] += 1.0  # skewed towards some experts
    return x, torch.randn(1, t, H, generator=gen)


def _ep_local(ref: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
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


def ep_agree(actual, single, exact, what: str, length: int, p: torch.Tensor | None = None):
    """The rule on ``actual`` against ``single`` (one run or several) and ``exact``, both cut
    to this rank's part of parameter ``p`` when given."""
    if p is not None:
        single = (
            [_ep_local(t, p) for t in single] if isinstance(single, list) else _ep_local(single, p)
        )
        exact = _ep_local(exact, p)
    return assert_agree(actual, single, exact, length=length, what=what)


def tp2_ep2_run(family: str, tmp: str):
    """On each rank of TP 2 x EP 2 x DP 2: the parallelized MoE model ``family`` (its blocks
    ``HFMoEBlock``) against the dense one, logits, loss and every gradient on this replica's
    half of the batch, then 3 SGD steps under DDP; it saves as the HF model (``save_hf``) and
    loads back bit for bit. Returns (converted expert names, the dense runs' trained weights:
    fp32, twin, float64, the longest reduction)."""
    from _hf import build, exact  # transformers only here: the blocks' tests skip one by one

    mesh = make_mesh(tp=2, ep=2, dp=2)  # the experts split over both dp ranks
    dense = build(family)
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
    ep_agree(out.logits, logits32, logits64, "logits", n)
    ep_agree(out.loss, loss32, loss64, "loss", n)
    names = set()
    for name, p in model.named_parameters():
        names.add(name)

        def want(grads, name=name, p=p):
            if expert_layout(p) is not None:
                return sum(g[name].grad for g in grads)
            return grads[mesh.dp_rank][name].grad

        ep_agree(p.grad, want(grads32), want(grads64), f"grad of {name}", n, p)
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
        ep_agree(
            p.detach(),
            [trained[0][name], trained[1][name]],
            trained[2][name],
            f"after 3 steps {name}",
            n,
            p,
        )
    # the sharded model saves as the HF model, and loads back: a round trip, bit for bit
    save_hf(model, tmp, mesh=mesh)
    fresh = parallelize(build(family), mesh=mesh)
    load_hf(fresh, tmp)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), f"load_hf: {name}"
    converted = [n for n, _ in model.named_parameters() if n.endswith("gate_up_proj")]
    return converted, trained, n


def check_saved_as_hf(family: str, tmp_path) -> None:
    """``tp2_ep2_run`` on 4 ranks; what it saved, loaded by transformers, is the dense model
    trained alike (by the rule)."""
    transformers = pytest.importorskip("transformers")
    names, trained, n = run_ranks(tp2_ep2_run, 4, family, str(tmp_path), timeout=240)[0]
    assert names, "no MoE block was converted"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float()
    got = dict(loaded.named_parameters())
    single, twin, exact = trained
    assert set(got) == set(single)
    for name, t in single.items():  # what HF loads is the dense model trained alike
        assert_agree(got[name], [t, twin[name]], exact[name], length=n, what=f"loaded {name}")
