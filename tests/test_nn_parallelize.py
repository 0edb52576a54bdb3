"""parallelize() on plain transformers: same logits, every gradient and the same training curve."""

from __future__ import annotations

import copy
import fnmatch

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import LLAMA_PLAN, NANO_HEADS, NANO_PLAN, Llama, NanoGPT
from _parity import assert_close, local_slice
from torch import nn

from fastpar import parallelize
from fastpar.nn import ColumnParallelLinear, VocabParallelEmbedding, param_layout
from fastpar.nn.functional import vocab_parallel_cross_entropy
from fastpar.testing import RankError, run_ranks


def _fused(name: str) -> int:
    return 3 if fnmatch.fnmatchcase(name, "h.*.attn.c_attn.*") else 1


def _gathered_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    world = dist.get_world_size()
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, -1)[..., :vocab]


def _train_and_compare(model_name: str, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    dense = NanoGPT() if model_name == "nano" else Llama()
    par = copy.deepcopy(dense)
    if model_name == "nano":
        parallelize(par, NANO_PLAN, heads=NANO_HEADS)
        vocab = 101
    else:
        parallelize(par, LLAMA_PLAN)
        vocab = 96
    world = dist.get_world_size()
    # the swap happened, heads were divided, ties were kept
    if model_name == "nano":
        assert isinstance(par.wte, VocabParallelEmbedding)
        assert par.lm_head.weight is par.wte.weight
        assert par.h[0].attn.n_head == 4 // world and par.h[0].attn.n_embd == 32 // world
    else:
        assert isinstance(par.layers[0].self_attn.q_proj, ColumnParallelLinear)
        assert par.layers[0].self_attn.num_key_value_heads == 4 // world
    opt_d = torch.optim.AdamW(dense.parameters(), lr=3e-3)
    opt_p = torch.optim.AdamW(par.parameters(), lr=3e-3)
    dense_params = dict(dense.named_parameters())
    losses = []
    for step in range(steps):
        torch.manual_seed(1000)  # one fixed batch: the loss must fall as the model fits it
        idx = torch.randint(0, vocab, (3, 16))
        tgt = torch.randint(0, vocab, (3, 16))
        logits_d = dense(idx)
        loss_d = F.cross_entropy(logits_d.flatten(0, 1), tgt.flatten())
        logits_p = par(idx)
        if (
            logits_p.shape[-1] != vocab
        ):  # vocab-parallel logits (Llama's lm_head): gather to compare
            full = _gathered_logits(logits_p, vocab)
            assert_close(
                logits_p,
                local_slice(logits_d.detach().transpose(0, -1), par.lm_head.weight).transpose(
                    0, -1
                ),
                "local logits",
            )
            # the vocab-parallel cross-entropy on the local logits: no gather needed
            loss_p = vocab_parallel_cross_entropy(logits_p.flatten(0, 1), tgt.flatten())
            opt_p.zero_grad()
            loss_p.backward()
        else:
            loss_p = F.cross_entropy(logits_p.flatten(0, 1), tgt.flatten())
            opt_p.zero_grad()
            loss_p.backward()
        assert_close(
            logits_p if logits_p.shape[-1] == vocab else full.detach(), logits_d.detach(), "logits"
        )
        opt_d.zero_grad()
        loss_d.backward()
        for name, p in par.named_parameters():
            ref = dense_params[name].grad
            expect = ref if param_layout(p) is None else local_slice(ref, p, _fused(name))
            assert_close(p.grad, expect, f"grad of {name} at step {step}")
        assert_close(loss_p.detach(), loss_d.detach(), f"loss at step {step}")
        losses.append(float(loss_p))
        opt_d.step()
        opt_p.step()
    return losses


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("model", ["nano", "llama"])
def test_parallelized_model_matches_dense(world, model):
    losses = run_ranks(_train_and_compare, world, model)
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
