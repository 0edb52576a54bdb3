"""VocabParallelEmbedding against nn.Embedding: init, output, gradient, padding, bad ids.

The weight is a slice of nn.Embedding's draws and the output a lookup (a copy) whose all-reduce
adds only exact zeros from the other ranks: both equal bit for bit. The weight gradient sums the
output gradient's rows per token on another shape (this rank's rows, the others masked to zero),
so it is judged by ``fastpar.tolerance``'s rule against the same sum in float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _parity import agree, exact_copy, local_slice
from torch import nn

from fastpar.nn import VocabParallelEmbedding, param_layout
from fastpar.testing import RankError, run_ranks


def _parity(vocab: int, padding_idx) -> None:
    torch.manual_seed(11)
    ref = nn.Embedding(vocab, 16, padding_idx=padding_idx)
    torch.manual_seed(11)
    emb = VocabParallelEmbedding(vocab, 16, padding_idx=padding_idx)
    world = dist.get_world_size()
    assert emb.weight.shape == (-(-vocab // world), 16)
    # a slice of the same draws: bit for bit
    assert torch.equal(emb.weight, local_slice(ref.weight.detach(), emb.weight))
    assert param_layout(emb.weight).kind == "sharded"
    # the random stream is left where nn.Embedding leaves it
    after = torch.rand(2)
    torch.manual_seed(11)
    nn.Embedding(vocab, 16, padding_idx=padding_idx)
    assert torch.equal(after, torch.rand(2))

    torch.manual_seed(12)
    ids = torch.randint(0, vocab, (5, 37))
    ids[0, :3] = torch.tensor([0, vocab - 1, padding_idx if padding_idx is not None else 1])
    gy = torch.randn(5, 37, 16)
    ref64 = exact_copy(ref)
    yr = ref(ids)
    yr.backward(gy)
    ref64(ids).backward(gy.double())
    yp = emb(ids)
    # a lookup, and the other ranks' exact zeros added to it: bit for bit
    assert torch.equal(yp, yr.detach()), "output differs from nn.Embedding's"
    yp.backward(gy)
    agree(
        emb.weight.grad,
        ref.weight.grad,
        ref64.weight.grad,
        "weight grad",
        length=ids.numel(),
        param=emb.weight,
    )


@pytest.mark.parametrize("world", [1, 2, 4])
def test_embedding_parity(world):
    def cases():
        for vocab in (128, 123):  # 123 is padded for TP = 2, 4
            for padding_idx in (None, 5, 122):
                _parity(vocab, padding_idx)

    run_ranks(cases, world)


def _bad_ids(bad: int) -> None:
    emb = VocabParallelEmbedding(10, 4)
    emb(torch.tensor([[1, 2], [bad, 3]]))


@pytest.mark.parametrize("bad", [-1, 10, 10_000])
def test_out_of_range_ids_are_clear_errors(bad):
    with pytest.raises(RankError, match=r"token id out of range: every id must be in \[0, 10\)"):
        run_ranks(_bad_ids, 2, bad)


def _unchecked() -> list:
    emb = VocabParallelEmbedding(10, 4, check_ids=False)
    # with the check off an out-of-range id on this rank's range maps to nothing: zero row
    return emb(torch.tensor([12])).tolist()


def test_check_can_be_turned_off():
    assert run_ranks(_unchecked, 2) == [[[0.0] * 4]] * 2


def test_float_ids_rejected_without_process_group():
    emb = VocabParallelEmbedding(10, 4)
    with pytest.raises(TypeError, match=r"must be an integer tensor, got torch\.float32"):
        emb(torch.tensor([1.0]))


def _from_dense() -> None:
    torch.manual_seed(3)
    dense = nn.Embedding(21, 8)
    emb = VocabParallelEmbedding.from_dense(dense)
    ids = torch.arange(21).view(3, 7)
    # a slice of the dense weight looked up, zeros added: bit for bit
    assert torch.equal(emb(ids), dense(ids).detach()), "from_dense output"


def test_from_dense():
    run_ranks(_from_dense, 4)
