"""The global grad norm counts every parameter exactly once, for TP / PP / DP / EP layouts, and
clipping gives what torch.nn.utils.clip_grad_norm_ gives on the single-process model.

A norm summed per shard and all-reduced, and gradients from a tensor-parallel model, round
otherwise than the single process: they are judged by ``fastpar.tolerance``'s rule, against the
same math in float64 (the dense model's float64 copy; the drawn gradients' squares summed in
float64), with the fp32 single-process values (and the dense model's twin, weights one ulp away)
as the measure of rounding. An inf norm is a maximum of the same values: exact in any order."""

from __future__ import annotations

import copy
import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F
from _mesh import make_mesh
from _models import NANO_HEADS, NANO_PLAN, NanoGPT
from _parity import exact_copy, local_slice

from fastpar import parallelize
from fastpar.amp import clip_grad_norm_, global_grad_norm
from fastpar.nn.marks import (
    mark_duplicated,
    mark_expert,
    mark_replicated,
    mark_sharded,
    param_layout,
)
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree, nudge


def _fused(name: str) -> int:
    return 3 if fnmatch.fnmatchcase(name, "h.*.attn.c_attn.*") else 1


def _norm_length(tensors) -> int:
    """The longest sum of a global norm of ``tensors``: one tensor's squares, or the tensors'."""
    tensors = list(tensors)
    return max(len(tensors), max(t.numel() for t in tensors))


def _nano_norm_and_clip(tp: int, dp: int) -> None:
    mesh = make_mesh(tp=tp)
    assert mesh.dp_size == dp
    torch.manual_seed(0)
    dense = NanoGPT()
    par = parallelize(copy.deepcopy(dense), NANO_PLAN, mesh, heads=NANO_HEADS)
    twin, exact = exact_copy(dense).float(), exact_copy(dense)  # the rule's references
    nudge(twin, seed=1)
    refs = (dense, twin, exact)
    torch.manual_seed(1)  # same data on every DP replica: DP-reduced grads equal these
    idx = torch.randint(0, 101, (2, 16))
    tgt = torch.randint(0, 101, (2, 16))
    for m in (*refs, par):
        F.cross_entropy(m(idx).flatten(0, 1), tgt.flatten()).backward()
    length = reduction_length(dense, idx)
    norm_length = max(length, _norm_length(dense.parameters()))
    where = f"rank {mesh.rank} (tp {mesh.tp_rank})"

    def norms(norm_type):
        return [
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e9, norm_type=norm_type)
            for m in refs
        ]  # just the norm

    want = norms(2.0)
    got = global_grad_norm(par.parameters(), mesh=mesh)
    assert_agree(got, want[:2], want[2], length=norm_length, what=f"global L2 norm on {where}")
    want_inf = norms("inf")
    got_inf = global_grad_norm(par.parameters(), mesh=mesh, norm_type=math.inf)
    assert_agree(got_inf, want_inf[:2], want_inf[2], length=length, what=f"inf norm on {where}")
    # clipping to a third of the norm: the same clipped gradients as torch on the dense model
    max_norm = float(want[0]) / 3
    for m in refs:
        torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=max_norm)
    clip_grad_norm_(par.parameters(), max_norm, mesh=mesh)
    ref_params = [dict(m.named_parameters()) for m in refs]
    for name, p in par.named_parameters():
        expect = [
            r[name].grad if param_layout(p) is None else local_slice(r[name].grad, p, _fused(name))
            for r in ref_params
        ]
        assert_agree(
            p.grad,
            expect[:2],
            expect[2],
            length=norm_length,
            what=f"clipped grad of {name} on {where}",
        )


@pytest.mark.parametrize("tp,world", [(1, 1), (2, 2), (4, 4), (2, 4)])
def test_nano_gpt_norm_and_clipping_match_single_process(tp, world):
    run_ranks(_nano_norm_and_clip, world, tp, world // tp)


def _synthetic(tp: int, pp: int, ep: int) -> tuple[float, float]:
    """Logical model per stage s: a vocab-sharded embedding tied between the first and last stage,
    an unmarked norm weight, a column weight (sharded), a row bias (replicated over TP), and one
    expert per EP rank (replicated over expert-dp). Gradients drawn from one seed everywhere."""
    mesh = make_mesh(tp=tp, pp=pp, ep=ep)
    torch.manual_seed(42)
    emb = torch.randn(10, 4)
    stages = [
        {
            "ln": torch.randn(4),
            "col": torch.randn(8, 4),
            "bias": torch.randn(4),
            "experts": [torch.randn(6, 4) for _ in range(ep)],
        }
        for _ in range(pp)
    ]

    def sum_of_squares(dtype):
        return emb.to(dtype).pow(2).sum() + sum(
            st["ln"].to(dtype).pow(2).sum()
            + st["col"].to(dtype).pow(2).sum()
            + st["bias"].to(dtype).pow(2).sum()
            + sum(e.to(dtype).pow(2).sum() for e in st["experts"])
            for st in stages
        )

    want, exact = sum_of_squares(torch.float32), sum_of_squares(torch.float64)
    every = [emb] + [t for st in stages for t in (st["ln"], st["col"], st["bias"], *st["experts"])]
    want_inf = max(
        t.abs().max() for st in stages for t in [st["ln"], st["col"], st["bias"], *st["experts"]]
    )
    want_inf = max(want_inf, emb.abs().max())

    def param(grad):
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        return p

    st = stages[mesh.pp_rank]
    params = []
    if mesh.is_first_stage or mesh.is_last_stage:
        e = param(emb.chunk(tp, 0)[mesh.tp_rank])
        mark_sharded(e, 0, mesh.tp_group, 10)
        if pp > 1:
            mark_duplicated(e, mesh.embedding_group)
        params.append(e)
    params.append(param(st["ln"]))  # unmarked: replicated over TP
    col = param(st["col"].chunk(tp, 0)[mesh.tp_rank])
    mark_sharded(col, 0, mesh.tp_group, 8)
    bias = param(st["bias"])
    mark_replicated(bias, mesh.tp_group)
    expert = param(st["experts"][mesh.ep_rank])
    mark_expert(expert)
    params += [col, bias, expert]
    got = global_grad_norm(params, mesh=mesh)
    got_inf = global_grad_norm(params, mesh=mesh, norm_type=math.inf)
    assert_agree(
        got,
        want.sqrt(),
        exact.sqrt(),
        length=_norm_length(every),
        what=f"synthetic L2 norm on rank {mesh.rank}",
    )
    # bit for bit: a maximum of the same fp32 values, whatever the order
    assert float(got_inf) == float(want_inf), f"synthetic inf norm: {float(got_inf)} != {want_inf}"
    return float(got), float(got_inf)


@pytest.mark.parametrize(
    "world,tp,pp,ep", [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 2, 2), (8, 1, 2, 4), (8, 2, 1, 2)]
)
def test_every_parameter_counted_once(world, tp, pp, ep):
    out = run_ranks(_synthetic, world, tp, pp, ep)
    assert len(set(out)) == 1  # identical on every rank: one all-reduced value


def test_without_process_group():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert global_grad_norm([p]).item() == 5.0
    norm = clip_grad_norm_([p], 1.0)
    assert norm.item() == 5.0
    # 3 and 4 times 1 / (5 + 1e-6) (torch's clip coefficient) in float64; the fp32 result is a
    # few roundings (of at most 2^-24 each) away
    exact = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64) / (5.0 + 1e-6)
    torch.testing.assert_close(p.grad.double(), exact, rtol=4 * 2**-24, atol=0, msg="clipped")
    with pytest.raises(ValueError, match="norm_type must be 2 or inf"):
        global_grad_norm([p], norm_type=1.0)
