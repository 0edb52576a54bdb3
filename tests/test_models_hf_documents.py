"""Hugging Face models (``--hf-config``) on packed documents (``fastpar.models.hf_documents``).

Tiny random models (nothing downloaded) built by ``fastpar.models.hf.hf_blocks``, in float64:
each document of a packed row gives the logits it gives alone; a packed batch's gradients are
those of the sum of its documents' runs and of HF's own eager model given an explicit 4D mask;
with no documents current the blocks are HF's model bit for bit; the families and settings that
cannot honour documents are refused; TP 2 with documents equals one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _hf import GQA, VOCAB, config
from torch import nn

from fastpar.models import hf_documents
from fastpar.models.documents import Documents, documents
from fastpar.models.hf import build, check_documents, hf_blocks

FAMILIES = ("llama", "qwen2", "gpt2")
LENGTHS = ((5, 4, 7), (9, 1, 6))  # two rows of 3 documents each, S = 16
SEQ = 16


def _doc_ids(lengths=LENGTHS) -> torch.Tensor:
    return torch.stack(
        [
            torch.repeat_interleave(torch.arange(len(r)) + 3 * i, torch.tensor(r))
            for i, r in enumerate(lengths)
        ]
    )


def _ids(rows: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def _model(family: str, attn: str = "sdpa", dtype=torch.float64, **overrides) -> nn.Module:
    torch.manual_seed(0)
    cfg = config(family, **overrides)
    cfg._attn_implementation = attn
    return nn.Sequential(*hf_blocks(cfg, None).blocks).to(dtype)


def _stock(family: str, attn: str = "sdpa", dtype=torch.float64, **overrides):
    """HF's own model with the same weights (hf_blocks draws ``build(config)`` first)."""
    torch.manual_seed(0)
    cfg = config(family, **overrides)
    cfg._attn_implementation = attn
    return build(cfg).to(dtype)


def _loss_sum(logits: torch.Tensor, ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the targets inside each document."""
    same = doc_ids[:, 1:] == doc_ids[:, :-1]
    targets = torch.where(same, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )


def _spans(lengths):
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            yield r, start, start + n
            start += n


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_document_as_if_alone(family, attn):
    model = _model(family, attn)
    ids, doc_ids = _ids(), _doc_ids()
    with documents(Documents.of(doc_ids)):
        packed = model(ids)
    for r, a, b in _spans(LENGTHS):
        alone = model(ids[r : r + 1, a:b])
        # HF's eager softmax runs in float32 (the alone runs' fallback); SDPA's in float64
        atol = 1e-10 if attn == "sdpa" or family == "gpt2" else 1e-6
        torch.testing.assert_close(packed[r : r + 1, a:b], alone, rtol=0, atol=atol)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_dense_references(family):
    model = _model(family)
    ids, doc_ids = _ids(seed=1), _doc_ids()
    params = dict(model.named_parameters())
    with documents(Documents.of(doc_ids)):
        loss = _loss_sum(model(ids), ids, doc_ids)
    grads = torch.autograd.grad(loss, list(params.values()))
    packed = {_hf_name(n, family): g for n, g in zip(params, grads, strict=True)}

    # the sum of each document's run alone
    ref = sum(
        _loss_sum(model(ids[r : r + 1, a:b]), ids[r : r + 1, a:b], doc_ids[r : r + 1, a:b])
        for r, a, b in _spans(LENGTHS)
    )
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-10)
    alone = torch.autograd.grad(ref, list(params.values()))
    for (name, g), want in zip(packed.items(), alone, strict=True):  # same order
        torch.testing.assert_close(g, want, rtol=0, atol=1e-10, msg=f"grad of {name}")

    # HF's own model (SDPA: float64 softmax) given a dense 4D mask and the restarting positions
    stock = _stock(family)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    positions = Documents.of(doc_ids).positions()
    out = stock(
        input_ids=ids, attention_mask=mask[:, None], position_ids=positions, use_cache=False
    ).logits
    dense_loss = _loss_sum(out, ids, doc_ids)
    torch.testing.assert_close(loss, dense_loss, rtol=0, atol=1e-10)
    dense = dict(stock.named_parameters())
    grads = torch.autograd.grad(dense_loss, list(dense.values()))
    for (name, _), g in zip(dense.items(), grads, strict=True):
        torch.testing.assert_close(packed[name], g, rtol=0, atol=1e-10, msg=f"grad of {name}")


def _hf_name(name: str, family: str) -> str:
    """A block sequence's parameter name as the HF model's ("3.model.layers.2.mlp..." ->
    "model.layers.2.mlp..."; GPT-2's one block holds the model: "0.model.transformer...")."""
    name = name.split(".", 1)[1]
    return name.removeprefix("model.") if family == "gpt2" else name


def test_no_dense_mask_is_built():
    """With documents current the attention gets no mask (the mask function returns None)."""
    from transformers import AttentionInterface

    seen = []
    real = hf_documents._attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return real(module, query, key, value, attention_mask, **kwargs)

    for family in ("llama", "gpt2"):
        model = _model(family)
        try:
            AttentionInterface.register(hf_documents.ATTENTION, spy)
            with documents(_doc_ids()):
                model(_ids())
        finally:
            AttentionInterface.register(hf_documents.ATTENTION, real)
    assert len(seen) == 4 and all(m is None for m in seen)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_without_documents_as_before(family, attn):
    """No documents current: HF's model, bit for bit (fp32, the fallback attention)."""
    model, stock = _model(family, attn, torch.float32), _stock(family, attn, torch.float32)
    cfg = next(m for m in model.modules() if hasattr(m, "config")).config
    assert (
        cfg._attn_implementation
        == {"sdpa": "fastpar_documents", "eager": "fastpar_documents_eager"}[attn]
    )
    assert stock.config._attn_implementation == attn
    ids = _ids()
    assert torch.equal(model(ids), stock(input_ids=ids, use_cache=False).logits)
    with documents(None):
        assert torch.equal(model(ids), stock(input_ids=ids, use_cache=False).logits)


def test_one_document_rows_and_no_reset_positions():
    model = _model("llama")
    ids = _ids()
    with documents(Documents.of(torch.zeros(2, SEQ, dtype=torch.long))):
        one = model(ids)
    torch.testing.assert_close(one, model(ids), rtol=0, atol=1e-10)
    # positions of the row (reset_positions=False): attention stops, RoPE keeps counting
    stock = _stock("llama")
    doc_ids = _doc_ids()
    with documents(Documents.of(doc_ids, reset_positions=False)):
        packed = model(ids)
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(SEQ, SEQ).bool().tril()
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    want = stock(input_ids=ids, attention_mask=mask[:, None], use_cache=False).logits
    torch.testing.assert_close(packed, want, rtol=0, atol=1e-10)


def test_refusals():
    with pytest.raises(ValueError, match=r"bert model: it is not a causal LM"):
        check_documents(config("bert"))
    bert = nn.Sequential(*hf_blocks(config("bert"), None).blocks)
    with documents(_doc_ids()), pytest.raises(ValueError, match="not a causal LM"):
        bert(_ids())
    with pytest.raises(ValueError, match=r"mistral model using sliding-window .*sliding_window"):
        check_documents(config("mistral", sliding_window=8))
    check_documents(config("mistral"))  # sliding_window None: fine
    with pytest.raises(ValueError, match=r"qwen2 model using sliding-window"):
        check_documents(config("qwen2", use_sliding_window=True, max_window_layers=0))
    sliding = _model("mistral", sliding_window=8)
    with documents(_doc_ids()), pytest.raises(ValueError, match="sliding-window"):
        sliding(_ids())
    gemma = transformers_config("GemmaConfig")
    with pytest.raises(ValueError, match=r"gemma model are not supported.*--pack stream"):
        check_documents(gemma)

    model = _model("llama")
    ids = _ids()
    long_ids = torch.zeros(2, 2 * SEQ, dtype=torch.long)  # the whole row; the model sees half
    with documents(long_ids), pytest.raises(ValueError, match=r"--cp > 1 are not supported"):
        model(ids)
    with documents(_doc_ids()), pytest.raises(ValueError, match="padding attention_mask"):
        model((ids, torch.ones_like(ids)))
    with documents(_doc_ids()[:1]), pytest.raises(ValueError, match=r"the model's rows"):
        model(ids)
    # a model not switched to the documents attention refuses rather than attend across
    plain = build(config("llama"))
    with documents(_doc_ids()), pytest.raises(ValueError, match="attn_implementation='eager'"):
        hf_documents.positions(plain.config, ids)
    assert hf_documents.enable(plain) and hf_documents.positions(plain.config, ids) is None


def transformers_config(name: str):
    import transformers

    return getattr(transformers, name)(**GQA)


def _tp_logits(family: str) -> tuple[float, float]:
    """On each rank of TP 2: the packed logits of this rank's vocabulary shard, against the
    single-process model's with documents; and the packed loss's backward runs."""
    import torch.distributed as dist
    from _mesh import make_mesh

    ids, doc_ids = _ids(), _doc_ids()
    ref_model = _model(family)
    with documents(doc_ids):
        ref = ref_model(ids)
    mesh = make_mesh(tp=2)
    torch.manual_seed(0)
    par = nn.Sequential(*hf_blocks(config(family), mesh).blocks).double()
    with documents(doc_ids):
        local = par(ids)
    per = -(-VOCAB // 2)
    rank = dist.get_rank(mesh.tp_group)
    real = min(per, VOCAB - rank * per)
    diff = (local[..., :real] - ref[..., rank * per : rank * per + real]).abs().max().item()
    with documents(doc_ids):
        local.sum().backward()
    return diff, int(local.shape[-1])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tp2_matches_one_process(family):
    from fastpar.testing import run_ranks

    for diff, width in run_ranks(_tp_logits, 2, family, timeout=120):
        assert width == -(-VOCAB // 2)
        assert diff < 1e-10
