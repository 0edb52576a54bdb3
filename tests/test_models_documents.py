"""Packed documents through the models (``fastpar.models.documents``): inside a packed row a
document's logits are those of the same document run alone (attention stops at its start and,
with ``reset_positions``, its positions restart at 0), for the GPT (learned positions) and the
Llama (RoPE, grouped-query attention), in float64 so that the comparison is of the math, not
of roundings. Without reset positions a later document's GPT logits differ (its learned
positions are the row's). fp32 gradients through the packed model against float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastpar import tolerance
from fastpar.models import GPTConfig, LlamaConfig, build_model
from fastpar.models.documents import Documents, documents

V, S = 64, 24
LENGTHS = [5, 1, 11, 7]  # a one-token document too


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "gpt":
        cfg = GPTConfig(vocab_size=V, seq_len=S, hidden=32, heads=4, layers=2, moe_every=0)
    else:
        cfg = LlamaConfig(vocab_size=V, seq_len=S, hidden=32, heads=4, kv_heads=2, layers=2)
    return nn.Sequential(*build_model(cfg)).double()


def _row():
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(1))
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    return ids, doc


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_packed_document_equals_the_document_alone(kind):
    model = _model(kind)
    ids, doc = _row()
    with torch.no_grad(), documents(Documents.of(doc)):
        packed = model(ids).view(1, S, V)
    start = 0
    with torch.no_grad():
        for n in LENGTHS:
            alone = model(ids[:, start : start + n]).view(1, n, V)
            err = (packed[:, start : start + n] - alone).abs().max().item()
            assert err < 1e-12, f"{kind}: document at {start} (length {n}) differs by {err}"
            start += n


def test_without_reset_positions_a_later_document_sees_its_row_positions(kind="gpt"):
    """Learned positions: a document at row positions 6..16 is not the document alone. (RoPE
    is relative: within a document only offsets between positions matter, so for the Llama
    the reset changes roundings only.)"""
    model = _model(kind)
    ids, doc = _row()
    with torch.no_grad(), documents(Documents.of(doc, reset_positions=False)):
        packed = model(ids).view(1, S, V)
    with torch.no_grad():
        alone = model(ids[:, 6:17]).view(1, 11, V)  # the third document, at positions 6..16
    assert (packed[:, 6:17] - alone).abs().max().item() > 1e-6
    with torch.no_grad():  # the first document starts at 0 either way
        first = model(ids[:, :5]).view(1, 5, V)
    assert (packed[:, :5] - first).abs().max().item() < 1e-12


def test_documents_are_checked():
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        Documents.of(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="int32 / int64"):
        Documents.of(torch.zeros(1, 4))


def dense_document_attention(q, k, v, ids, scale=None):
    """The reference: a dense [B, 1, T, T] mask (same document, causal) and plain softmax
    (``scale`` as ``document_attention``'s: None is 1/sqrt(D))."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    mask = (ids[:, :, None] == ids[:, None, :]) & causal
    s = q @ k.transpose(-1, -2)
    s = s / q.shape[-1] ** 0.5 if scale is None else s * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _grads(kind, dtype, dense, monkeypatch):
    import fastpar.models.common as common

    if dense:
        monkeypatch.setattr(common, "document_attention", dense_document_attention)
    else:
        monkeypatch.undo()
    model = _model(kind).to(dtype)
    ids = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(2))
    doc = torch.tensor([[0] * 5 + [1] * 1 + [2] * 18, [0] * S, [3] * 12 + [4] * 12])
    with documents(Documents.of(doc)):
        logits = model(ids)
    torch.nn.functional.cross_entropy(logits.double(), ids.roll(-1, 1).flatten()).backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_fp32_gradients_through_packed_rows_agree_with_float64(kind, monkeypatch):
    actual = _grads(kind, torch.float32, False, monkeypatch)
    single = _grads(kind, torch.float32, True, monkeypatch)
    exact = _grads(kind, torch.float64, True, monkeypatch)
    for name, g in actual.items():
        tolerance.assert_agree(g, single[name], exact[name], length=3 * S, what=name)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_compiled_blocks_read_each_batchs_documents_without_recompiling(kind):
    """Under torch.compile (dynamo's eager backend: the tracing, not inductor's code) every
    block reads the running batch's documents: the same logits and gradients as eager, and new
    document layouts do not recompile (the documents are read outside the graph)."""
    from fastpar.train.compile import compile_blocks

    torch._dynamo.reset()  # (another model's compiled code of the same functions: no recompile)
    eager, compiled = _model(kind).float(), _model(kind).float()
    assert compile_blocks(compiled, backend="eager")
    gen = torch.Generator().manual_seed(3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            ids = torch.randint(0, V, (2, S), generator=gen)
            cuts = torch.randint(1, S, (2, 3), generator=gen)
            doc = (torch.arange(S)[None, None] >= cuts[:, :, None]).sum(1)
            with documents(Documents.of(doc)):
                a, b = eager(ids), compiled(ids)
            assert torch.equal(a, b)
            a.square().sum().backward()
            b.square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
