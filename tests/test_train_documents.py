"""Packed documents and masked targets in the training command, proven by ``fastpar.verify``
against one device training on the whole global batch in one piece.

The data: byte text (vocabulary 256) whose newline (id 10) ends each document, and stretches
of empty documents ("\\n" after "\\n": every target ignored) beside long lines, so that ignored
targets fall very unevenly over rows, micro-batches and ranks. Under --loss-normalization
token (the default) dp 2 x pp 2 x tp 2 (interleaved too), ZeRO, recompute and dp 2 x ep 2 MoE
AGREE; the same dp 2 x pp 2 x tp 2 run under ``sequence`` (a mean of means) DISAGREES — the
check can fail. What cannot be exact yet is refused: documents with context parallelism or a
Hugging Face model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _flags import tiny_config, with_hf_config
from _trainer import every_gradient_agrees, first_step_gradients

from fastpar.train import TrainConfig, batch_of, launch
from fastpar.train.batches import load_data
from fastpar.verify import compare

SMALL = tiny_config(microbatches=2, seq_len=32, eos_id=10, moe_every=0, ep=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    words = "the quick brown fox jumps over a lazy dog while packed rows keep going on "
    parts = []
    for i in range(60):
        parts.append(words[: 20 + 9 * (i % 7)] + "\n")  # documents of 21 to 75 tokens
        parts.append("\n" * (30 + 11 * (i % 5)))  # empty ones: nothing to predict
    path.write_text("".join(parts))
    return str(path)


def test_documents_of_a_batch(data):
    cfg = TrainConfig.from_flags(**SMALL, data=data, tp=1, pp=1, dp=1)
    x, y, docs = batch_of(cfg, load_data(cfg), 0)
    for row_x, row_y, row_d in zip(x, y, docs.ids, strict=True):
        doc = 0
        for t in range(len(row_x)):  # plain Python: a newline ends its document
            assert row_d[t] == doc
            assert (row_y[t] == -100) == (row_x[t] == 10)
            doc += int(row_x[t] == 10)
    assert torch.equal(docs.valid, y != -100)  # the tokens MoE statistics count
    pos = docs.positions()
    assert (pos[docs.ids != torch.roll(docs.ids, 1, 1)] == 0).all()
    stream = TrainConfig.from_flags(**{**SMALL, "eos_id": None}, data=data)
    xs, ys, none = batch_of(stream, load_data(stream), 0)
    assert none is None and torch.equal(xs, x) and (ys != -100).all()  # a stream: same windows


def _skewed(cfg: TrainConfig):
    """The run's documents with a loss mask (as a fine-tuning set's) that leaves, on every
    step, data-parallel rank 0's first micro-batch no valid target and its second one valid
    target a row, so that rank 1 holds more than ten times rank 0's: the issue's uneven
    batches, checked by ``_check_skew``."""
    import numpy as np

    from fastpar.data import Corpus
    from fastpar.data.tokens import _window_starts

    corpus = load_data(cfg)
    mask = np.ones(len(corpus), np.uint8)
    per = cfg.batch_size // cfg.dp
    for step in range(cfg.steps):
        starts = _window_starts(len(corpus), step, cfg.batch_size, cfg.model.seq_len, cfg.seed)
        for r in range(per):  # rank 0's rows: every target masked ...
            s = int(starts[r])
            mask[s + 1 : s + cfg.model.seq_len + 1] = 0
    for step in range(cfg.steps):  # ... but one a row in its second micro-batch
        starts = _window_starts(len(corpus), step, cfg.batch_size, cfg.model.seq_len, cfg.seed)
        for r in range(per // cfg.microbatches, per):
            s = int(starts[r])
            y = batch_of(cfg, Corpus(corpus.tokens, corpus.starts, None), step)[1][r]
            inside = torch.nonzero(y != -100)  # targets inside a document (a row of empty
            if len(inside):  # documents has none)
                mask[s + 1 + int(inside[0])] = 1
    return Corpus(corpus.tokens, corpus.starts, mask, "the skewed documents")


def _check_skew(cfg: TrainConfig, corpus) -> None:
    for step in range(cfg.steps):
        _, y, _ = batch_of(cfg, corpus, step)
        valid = (y != -100).view(cfg.dp, cfg.microbatches, -1).sum(-1)  # [rank, micro-batch]
        assert valid[0, 0] == 0 and 0 < 10 * valid[0].sum() < valid[1].sum(), valid


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, pp=2, tp=2, zero=1),
        dict(dp=2, pp=2, tp=2, schedule="interleaved", virtual_stages=2, layers=4),
        dict(dp=2, pp=2, tp=1, zero=3, recompute=True, sequence_parallel=False),
        dict(dp=2, pp=1, tp=1, ep=2, moe_every=1, experts=4, top_k=2, zero=2),
        dict(dp=2, pp=2, tp=2, schedule="zb-h1"),
        dict(dp=2, pp=2, tp=2, schedule="zb-h1", sequence_parallel=True),
        dict(dp=2, pp=2, tp=2, fused_ce=True, zero=2, sequence_parallel=True),
        dict(dp=2, pp=1, tp=1, cp=2, zero=1),
        dict(dp=2, pp=1, tp=1, cp=2, cp_attention="all-to-all", model_type="llama", kv_heads=2),
        dict(dp=2, pp=2, tp=1, cp=2, ep=2, moe_every=1, experts=4, top_k=2),
    ],
    ids=[
        "dp2-pp2-tp2",
        "interleaved",
        "zero3-recompute",
        "dp2-ep2-moe",
        "zb-h1",
        "zb-h1-sp",
        "fused-ce-sp",
        "cp2-dp2-ring",
        "cp2-dp2-a2a-llama",
        "cp2-dp2-pp2-ep2-moe",
    ],
)
def test_token_normalization_agrees_with_one_device(data, layout):
    cfg = TrainConfig.from_flags(**{**SMALL, **layout}, data=data)
    corpus = _skewed(cfg)  # a micro-batch with no valid target, a rank with ten times more
    _check_skew(cfg, corpus)
    ok, text = compare(cfg, corpus)
    assert ok, text


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, pp=2, tp=2),
        dict(dp=2, pp=1, tp=1, cp=2),
        dict(dp=2, pp=1, tp=1, ep=2, moe_every=1, experts=4, top_k=2),
    ],
    ids=["dp2-pp2-tp2", "cp2-dp2", "dp2-ep2-moe"],
)
def test_uneven_batches_agree_and_a_mean_of_means_disagrees(data, layout):
    """The issue's three layouts on batches where one micro-batch has no valid target and one
    rank ten times the other's: AGREE under token normalisation, DISAGREE under sequence."""
    cfg = TrainConfig.from_flags(**{**SMALL, **layout}, data=data)
    corpus = _skewed(cfg)
    _check_skew(cfg, corpus)
    ok, text = compare(cfg, corpus)
    assert ok, text
    seq = dataclasses.replace(cfg, loss_normalization="sequence")
    ok, text = compare(seq, corpus)
    assert not ok and text.splitlines()[-1] == "DISAGREE", text


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(pack="documents", eos_id=None), "needs document boundaries"),
        (dict(eos_id=999), "not a token id"),
        (dict(loss_normalization="mean"), "token or sequence"),
    ],
)
def test_what_cannot_be_exact_is_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**{**SMALL, **flags}).check()


def test_a_step_with_no_valid_target_is_skipped_and_said(tmp_path, capfd):
    path = tmp_path / "empty.txt"
    path.write_text("\n" * 400)  # every document empty: every target ignored
    cfg = TrainConfig.from_flags(**{**SMALL, "quiet": False}, data=str(path), dp=2, pp=1, tp=1)
    records = launch(cfg)
    assert [r["skipped"] for r in records] == [True, True], records
    assert all(r["loss"] == 0.0 and r["grad_norm"] == 0.0 for r in records), records
    out = capfd.readouterr().out
    assert "step 1: the global batch has no valid target" in out, out


def _records():
    return [
        (f"question {i}: what follows {'ab' * (i % 9)}?", " the answer" * (1 + i % 4))
        for i in range(80)
    ]


def _jsonl(tmp_path) -> str:
    import json

    path = tmp_path / "sft.jsonl"
    with open(path, "w") as f:
        for prompt, completion in _records():
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return str(path)


def test_jsonl_prompts_predict_nothing_and_verify_agrees(tmp_path):
    """Fine-tuning records: every target inside a prompt is ignored, the completion's (and its
    end, --eos-id 0 appended) count; dp 2 x pp 2 AGREES with one device on the whole batch."""
    from fastpar.data.tokens import _window_starts

    cfg = TrainConfig.from_flags(**{**SMALL, "eos_id": 0}, data=_jsonl(tmp_path), dp=2, pp=2, tp=1)
    assert cfg.packs_documents and "records" in cfg.document_source
    stream, counts, doc = [], [], []  # plain Python: bytes, whether each counts, its document
    for i, (prompt, completion) in enumerate(_records()):
        body = list(prompt.encode()) + list(completion.encode()) + [0]
        stream += body
        counts += [False] * len(prompt) + [True] * (len(completion) + 1)
        doc += [i] * len(body)
    x, y, docs = batch_of(cfg, load_data(cfg), 1)
    for r, s in enumerate(
        _window_starts(len(stream), 1, cfg.batch_size, cfg.model.seq_len, cfg.seed)
    ):
        s = int(s)
        assert x[r].tolist() == stream[s : s + cfg.model.seq_len]
        for t in range(cfg.model.seq_len):
            j = s + t + 1  # the target's offset
            valid = counts[j] and doc[j] == doc[j - 1]
            assert int(y[r, t]) == (stream[j] if valid else -100), (r, t)
            assert int(docs.ids[r, t]) == doc[s + t] - doc[s]
    assert 0 < int((y != -100).sum()) < y.numel()
    ok, out = compare(cfg)
    assert ok, out


def test_bin_with_an_index_of_document_offsets(tmp_path):
    import numpy as np

    ids = (np.arange(3000) * 7 % 250).astype(np.uint16)
    ids.tofile(tmp_path / "tok.bin")
    starts = np.unique(np.r_[0, 41, np.arange(40, 2990, 53), 2999]).astype("<i8")
    starts.tofile(tmp_path / "tok.idx")
    cfg = TrainConfig.from_flags(
        **{**SMALL, "eos_id": None}, data=str(tmp_path / "tok.bin"), dp=2, pp=1, tp=2
    )
    assert cfg.packs_documents and "tok.idx" in cfg.document_source
    corpus = load_data(cfg)
    assert corpus.starts.tolist() == starts.tolist()
    x, y, docs = batch_of(cfg, corpus, 0)
    from fastpar.data.tokens import _window_starts

    for r, start in enumerate(
        _window_starts(len(ids), 0, cfg.batch_size, cfg.model.seq_len, cfg.seed)
    ):
        span = np.arange(int(start), int(start) + cfg.model.seq_len + 1)
        doc = np.searchsorted(starts, span, side="right") - 1  # each token's document
        assert x[r].tolist() == ids[span[:-1]].tolist()
        assert docs.ids[r].tolist() == (doc[:-1] - doc[0]).tolist()
        assert ((y[r] == -100).numpy() == (doc[1:] != doc[:-1])).all()
    assert (docs.ids[:, -1] > 0).any()  # some rows cross a document start
    ok, out = compare(cfg)
    assert ok, out
    with pytest.raises(ValueError, match="--pack stream with"):
        TrainConfig.from_flags(
            **{**SMALL, "eos_id": None}, data=_jsonl(tmp_path), pack="stream"
        ).check()


def test_the_tokenizers_end_of_document_token_packs_by_default(tmp_path):
    pytest.importorskip("tokenizers")
    from fastpar.tokenizer import main as tokenizer_main

    tok = str(tmp_path / "tok.json")
    assert tokenizer_main(["--vocab-size", "300", "--out", tok]) == 0
    base = {**SMALL, "eos_id": None, "vocab_size": 300}
    cfg = TrainConfig.from_flags(**base, tokenizer=tok)
    assert cfg.packs_documents and "tokenizer's end-of-document token (id" in cfg.document_source
    assert not TrainConfig.from_flags(**base, tokenizer=tok, pack="stream").packs_documents
    assert not TrainConfig.from_flags(**base).packs_documents  # bytes, no eos: a stream
    text = "one document<|endoftext|>and the next one<|endoftext|>" * 40
    (tmp_path / "t.txt").write_text(text)
    corpus = load_data(dataclasses.replace(cfg, data=str(tmp_path / "t.txt")))
    assert len(corpus.starts) == 80  # each end starts the next (the last ends the file)


def test_the_command_line_resets_positions_unless_told_not_to():
    from fastpar.train.cli import build_parser, config_from

    parse = build_parser().parse_args
    assert config_from(parse(["--eos-id", "10"]), None).reset_positions  # TrainConfig's default
    assert not config_from(parse(["--eos-id", "10", "--no-reset-positions"]), None).reset_positions


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, pp=2, tp=2, zero=0),
        dict(dp=2, pp=1, tp=1, cp=2, zero=0),
        dict(dp=2, pp=1, tp=1, ep=2, moe_every=1, experts=4, top_k=2, zero=0),
        # the checkpointed blocks run again in backward: inside their micro-batch's documents
        dict(dp=2, pp=2, tp=1, zero=0, recompute="attention", model_type="llama"),
    ],
    ids=["dp2-pp2-tp2", "cp2-dp2", "dp2-ep2-moe", "dp2-pp2-recompute-attention"],
)
def test_every_gradient_on_every_rank_is_the_single_process_models(data, layout):
    """Documents crossing micro-batch, stage and cp-chunk boundaries, ignored targets uneven:
    every rank's gradient of every parameter it holds (replicated copies included) is its
    piece of one device's gradient of the whole batch's token mean."""
    cfg = TrainConfig.from_flags(**{**SMALL, **layout, "steps": 1}, data=data)
    cfg.check()  # (every_gradient_agrees checks it again)
    corpus = _skewed(cfg)
    _check_skew(cfg, corpus)
    every_gradient_agrees(cfg, corpus)


def test_the_gradient_check_fails_for_a_mean_of_means(data):
    from fastpar.testing import run_ranks
    from fastpar.verify import references

    layout = dict(dp=2, pp=1, tp=1, cp=2, zero=0)
    cfg = TrainConfig.from_flags(
        **{**SMALL, "steps": 1}, data=data, **layout, loss_normalization="sequence"
    )
    corpus = _skewed(cfg)
    refs = references(cfg, corpus)  # (one device's token mean, whatever the run's)
    for lines in run_ranks(first_step_gradients, cfg.world_size, cfg, refs, corpus):
        assert len(lines) > 1 and "DISAGREE" in lines[1], lines


@pytest.mark.parametrize(
    "family, layout",
    [
        ("llama", dict(tp=2, pp=2, dp=2, zero=1)),  # positions and no masks between stages
        ("qwen2", dict(tp=2, pp=1, dp=2, zero=0)),
        ("gpt2", dict(tp=2, pp=1, dp=2, zero=2)),  # learned positions through position_ids
    ],
)
def test_hugging_face_models_with_packed_documents_agree(data, tmp_path, family, layout):
    """--hf-config models on packed documents: attention within each document and positions
    restarting (HF's position_ids), proven against one device on the whole batch."""
    import json

    from _hf import config as hf_config

    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(hf_config(family, vocab_size=300).to_dict()))
    base = with_hf_config({**SMALL, **layout, "microbatches": 2}, path)
    cfg = TrainConfig.from_flags(**base, data=data)
    ok, text = compare(cfg)
    assert ok, text


def test_hugging_face_families_that_cannot_pack_are_refused(data, tmp_path):
    import json

    from _hf import config as hf_config

    path = tmp_path / "bert.json"
    path.write_text(json.dumps(hf_config("bert", vocab_size=300).to_dict()))
    base = {k: v for k, v in SMALL.items() if k not in ("hidden", "heads", "layers")}
    with pytest.raises(ValueError, match="--pack documents with --hf-config"):
        TrainConfig.from_flags(**base, hf_config=str(path), data=data, tp=1, pp=1, dp=1).check()


def _val_losses(cfg):
    """On one rank: (the trainer's validation loss; every held-out batch's loss sum and count
    of valid targets, computed here from the same model on the whole batch)."""
    from fastpar import ParallelMesh
    from fastpar.models.documents import documents
    from fastpar.train.batches import eval_batch
    from fastpar.train.build import Trainer

    trainer = Trainer(cfg, ParallelMesh(1, 1, 1), torch.device("cpu"))
    for _ in range(cfg.steps):  # trained: the batches' means differ (at init all are ~ln V)
        trainer.step()
    got = trainer.evaluate()
    model = trainer.stage_module  # pp 1: the whole model
    model.eval()
    sums, counts = [], []
    with torch.no_grad():
        for j in range(cfg.eval_batches):
            x, y, docs = eval_batch(cfg, trainer.held_out, j)
            with documents(docs):
                logits = model(x).double().reshape(y.numel(), -1)
            valid = (y != -100).reshape(-1)
            logp = torch.log_softmax(logits[valid], dim=-1)
            sums.append(-float(logp.gather(1, y.reshape(-1)[valid][:, None]).sum()))
            counts.append(int(valid.sum()))
    return got, sums, counts


def test_val_loss_counts_each_held_out_target_once(tmp_path):
    """Held-out batches with very different counts of valid targets (prompts masked): the
    validation loss is the sum over every valid target of every batch over their count, not
    the mean of the batches' means (which this data tells apart); the same at dp 2 x pp 2
    (``fastpar.verify`` against one device)."""
    import json

    from fastpar.testing import run_ranks
    from fastpar.tolerance import floor

    held = dict(eos_id=0, eval_batches=6, eval_every=1, eval_split=0.3, microbatches=1, steps=12)
    held.update(batch_size=4)  # few rows a batch: their counts and means vary the more
    path, rng = tmp_path / "uneven.jsonl", torch.Generator().manual_seed(0)
    with open(path, "w") as f:  # long easy completions beside short random ones
        for i in range(200):
            noise = bytes(torch.randint(33, 127, (4,), generator=rng).tolist()).decode()
            completion = "z" * 90 if i % 3 == 0 else noise
            f.write(json.dumps({"prompt": f"prompt {i} " * (1 + i % 5), "completion": completion}))
            f.write("\n")
    cfg = TrainConfig.from_flags(**{**SMALL, **held}, data=str(path), dp=1, pp=1, tp=1)
    got, sums, counts = run_ranks(_val_losses, 1, cfg)[0]
    assert len(set(counts)) > 1 and min(counts) > 0, counts
    want = sum(sums) / sum(counts)
    means = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
    # the same fp32 logits: only the loss's fp32 reductions (over the vocabulary and the
    # targets) differ from the float64 sums here; the two definitions lie far further apart
    tol = floor(torch.float32, sum(counts) + cfg.vocab, abs(want))
    assert abs(got - want) <= tol, (got, want, tol, means)
    assert abs(means - want) > 20 * tol, (means, want, tol)  # the check can fail
    ok, out = compare(dataclasses.replace(cfg, dp=2, pp=2, microbatches=2, steps=2))
    assert ok, out
    assert "val_loss" in out, out
