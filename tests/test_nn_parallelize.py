"""parallelize() on plain transformers: same logits, every gradient and the same training curve.

The parallel model sums its products in per-rank parts and all-reduces them: every logit, loss
and gradient is judged by ``fastpar.tolerance``'s rule against the dense model's fp32 run, its
twin and its float64 run of the same AdamW training (``train_references``)."""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import LLAMA_PLAN, NANO_HEADS, NANO_PLAN, Llama, NanoGPT
from _parity import local_slice
from torch import nn

from fastpar import parallelize
from fastpar.nn import ColumnParallelLinear, VocabParallelEmbedding, param_layout
from fastpar.nn.functional import vocab_parallel_cross_entropy
from fastpar.parity import reduction_length
from fastpar.testing import RankError, run_ranks
from fastpar.tolerance import compare, train_references


def _fused(name: str) -> int:
    return 3 if fnmatch.fnmatchcase(name, "h.*.attn.c_attn.*") else 1


def _cols(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's columns (last dim) of ``t``, sliced like the column weight ``p``."""
    return local_slice(t.transpose(0, -1), p).transpose(0, -1)


def _gathered_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    world = dist.get_world_size()
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, -1)[..., :vocab]


def _ok(comparison) -> None:
    assert comparison.ok, str(comparison)


def _train_and_compare(model_name: str, steps: int = 4) -> list[float]:
    build = NanoGPT if model_name == "nano" else Llama
    vocab = 101 if model_name == "nano" else 96
    g = torch.Generator().manual_seed(1000)  # one fixed batch: the loss must fall as it fits
    idx = torch.randint(0, vocab, (3, 16), generator=g)
    tgt = torch.randint(0, vocab, (3, 16), generator=g)
    # the dense model's runs (fp32, its twin, float64), each step's logits kept
    logits_of_runs: list[list[torch.Tensor]] = []

    def dense_loss(model, step, dtype):
        logits = model(idx)
        if step == 0:
            logits_of_runs.append([])
        logits_of_runs[-1].append(logits.detach())
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())

    torch.manual_seed(0)
    length = reduction_length(build(), idx)
    refs = train_references(
        build, dense_loss, steps, length=length, seed=0, lr=3e-3, weight_decay=0.01
    )

    def logits_agree(step, actual, what, cut=lambda t: t):
        single, twin, exact = (cut(run[step]) for run in logits_of_runs)
        _ok(compare(actual, [single, twin], exact, length=length, what=f"{what} at step {step}"))

    torch.manual_seed(0)
    par = build()
    if model_name == "nano":
        parallelize(par, NANO_PLAN, heads=NANO_HEADS)
    else:
        parallelize(par, LLAMA_PLAN)
    world = dist.get_world_size()
    # the swap happened, heads were divided, ties were kept
    if model_name == "nano":
        assert isinstance(par.wte, VocabParallelEmbedding)
        assert par.lm_head.weight is par.wte.weight
        assert par.h[0].attn.n_head == 4 // world and par.h[0].attn.n_embd == 32 // world
    else:
        assert isinstance(par.layers[0].self_attn.q_proj, ColumnParallelLinear)
        assert par.layers[0].self_attn.num_key_value_heads == 4 // world
    named = dict(par.named_parameters())

    def local(full: torch.Tensor, name: str) -> torch.Tensor:
        p = named[name]
        return full if param_layout(p) is None else local_slice(full, p, _fused(name))

    refs.local = local
    opt_p = torch.optim.AdamW(par.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(steps):
        logits_p = par(idx)
        if logits_p.shape[-1] != vocab:  # vocab-parallel logits (Llama's lm_head): gather
            full = _gathered_logits(logits_p, vocab)
            logits_agree(step, logits_p, "local logits", lambda t: _cols(t, par.lm_head.weight))
            # the vocab-parallel cross-entropy on the local logits: no gather needed
            loss_p = vocab_parallel_cross_entropy(logits_p.flatten(0, 1), tgt.flatten())
        else:
            full = logits_p
            loss_p = F.cross_entropy(logits_p.flatten(0, 1), tgt.flatten())
        opt_p.zero_grad()
        loss_p.backward()
        logits_agree(step, full.detach(), "logits")
        for name, p in named.items():
            _ok(refs.grad(step, name, p.grad))
        _ok(refs.loss(step, float(loss_p)))
        losses.append(float(loss_p))
        opt_p.step()
    for name, p in named.items():  # and every parameter after the steps
        _ok(refs.param(name, p.detach()))
    return losses


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("model", ["nano", "llama"])
def test_parallelized_model_matches_dense(world, model):
    losses = run_ranks(_train_and_compare, world, model)
    # the same loss bit for bit on every rank: computed from the same all-gathered logits, or
    # the vocab-parallel cross-entropy's all-reduced sums
    assert all(lst == losses[0] for lst in losses)
    assert losses[0][-1] < losses[0][0]


def _bad_heads() -> None:
    parallelize(Llama(kv_heads=2, heads=4), LLAMA_PLAN)


def test_head_count_not_divisible_is_a_clear_error():
    with pytest.raises(
        RankError, match=r"num_key_value_heads=2, not divisible by the tensor-parallel size 4"
    ):
        run_ranks(_bad_heads, 4)


def test_plan_errors_without_process_group():
    with pytest.raises(ValueError, match=r"plan pattern 'nope\.\*' matches no module"):
        parallelize(Llama(), {"nope.*": "column"})
    with pytest.raises(ValueError, match="style must be one of"):
        parallelize(Llama(), {"lm_head": "diagonal"})
    with pytest.raises(
        TypeError, match=r"needs an nn.Linear or a Hugging Face Conv1D at 'norm', found RMSNorm"
    ):
        parallelize(Llama(), {"norm": "column"})
    with pytest.raises(ValueError, match="heads pattern 'zzz' matches no module"):
        parallelize(Llama(), {"lm_head": "column"}, heads={"zzz": ["x"]})
    m = parallelize(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), {"0": "column", "2": "row"}
    )
    x = torch.randn(2, 4)
    assert m(x).shape == (2, 4)
