"""Packed documents: eos boundaries, .idx index files, JSONL prompt/completion and
input_ids/loss_mask records, Corpus slicing, and document_batch's windows and targets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastpar import data

EOS = 9


def _bin(tmp_path, ids, name="train.bin"):
    path = tmp_path / name
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return str(path)


def _jsonl(tmp_path, records, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def test_eos_tokens_end_documents_in_a_bin(tmp_path):
    ids = [1, 2, EOS, 3, 4, 5, EOS, 6, EOS]
    c = data.load_documents(_bin(tmp_path, ids), eos_id=EOS)
    assert isinstance(c.tokens, np.memmap) and len(c) == 9
    assert c.starts.tolist() == [0, 3, 7]  # the final eos starts no document
    assert c.starts.dtype == np.int64 and c.loss_mask is None and c.has_boundaries
    one = data.load_documents(_bin(tmp_path, ids, "b.bin"))  # no eos id: one document
    assert one.starts.tolist() == [0] and not one.has_boundaries


def test_an_idx_file_defines_the_documents(tmp_path):
    path = _bin(tmp_path, [1, 2, EOS, 3, 4, 5, 6, 7])
    np.asarray([0, 4, 6], dtype="<i8").tofile(tmp_path / "train.idx")
    c = data.load_documents(path, eos_id=EOS)
    assert c.starts.tolist() == [0, 4, 6]


@pytest.mark.parametrize(
    "offsets,match",
    [([1, 4], "first document starts at 1"), ([0, 4, 4], "4"), ([0, 8], "8"), ([0, 5, 3], "3")],
)
def test_bad_idx_offsets_are_one_line_errors(tmp_path, offsets, match):
    path = _bin(tmp_path, range(8))
    np.asarray(offsets, dtype="<i8").tofile(tmp_path / "train.idx")
    with pytest.raises(ValueError, match=match) as err:
        data.load_documents(path)
    assert "train.idx" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "train.idx").write_bytes(b"\x00" * 12)  # not whole int64s
    with pytest.raises(ValueError, match="12 bytes"):
        data.load_documents(path)


def test_jsonl_prompt_completion_as_bytes(tmp_path):
    path = _jsonl(
        tmp_path, [{"prompt": "ab", "completion": "c"}, {"prompt": "", "completion": "de"}]
    )
    c = data.load_documents(path, eos_id=0)
    assert c.tokens.tolist() == [97, 98, 99, 0, 100, 101, 0]
    assert c.starts.tolist() == [0, 4]
    assert c.loss_mask.tolist() == [0, 0, 1, 1, 1, 1, 1]
    no_eos = data.load_documents(path)  # no tokenizer, no eos id: nothing appended
    assert no_eos.tokens.tolist() == [97, 98, 99, 100, 101] and no_eos.starts.tolist() == [0, 3]


def test_jsonl_input_ids_and_loss_mask(tmp_path):
    recs = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    c = data.load_documents(_jsonl(tmp_path, recs))
    assert c.tokens.tolist() == [5, 6, 7, 8] and c.starts.tolist() == [0, 3]
    assert c.loss_mask.tolist() == [0, 1, 1, 1]


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        json.dumps({"input_ids": [1, 2], "loss_mask": [1]}),
        json.dumps({"input_ids": [1, 2], "loss_mask": [1, 2]}),
        json.dumps({"text": "x"}),
        json.dumps([1, 2]),
    ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, bad):
    path = _jsonl(tmp_path, [{"input_ids": [1], "loss_mask": [1]}, bad])
    with pytest.raises(ValueError, match=r"d\.jsonl:2"):
        data.load_documents(path)


def test_mismatched_loss_mask_length():
    with pytest.raises(ValueError, match="loss mask"):
        data.Corpus(torch.arange(5), np.array([0]), np.ones(4, np.uint8))


def test_slicing_rebases_the_starts(tmp_path):
    c = data.Corpus(torch.arange(10), np.array([0, 3, 7]), np.arange(10) % 2)
    tail = c[5:]
    assert tail.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tail.starts.tolist() == [0, 2]  # the document cut at 5 starts at 0
    assert tail.loss_mask.tolist() == [1, 0, 1, 0, 1]
    assert c[3:7].starts.tolist() == [0] and len(c[:8]) == 8
    assert c[:8].starts.tolist() == [0, 3, 7]
    mm = data.load_documents(_bin(tmp_path, [1, EOS, 2, 3, EOS, 4]), eos_id=EOS)
    assert mm[1:].starts.tolist() == [0, 1, 4] and isinstance(mm[1:].tokens, np.ndarray)


def _expected(tokens, starts, mask, s, seq):
    """Plain-Python x, y, doc_ids of the row starting at s."""
    row = tokens[s : s + seq + 1]
    doc = [sum(1 for b in starts if s < b <= s + t) for t in range(seq + 1)]
    y = [
        -100 if doc[t + 1] != doc[t] or (mask is not None and mask[s + t + 1] == 0) else row[t + 1]
        for t in range(seq)
    ]
    return row[:seq], y, doc[:seq]


def test_document_batch_takes_the_streams_windows_and_masks_boundaries():
    tokens = [10, 11, EOS, 20, 21, 22, EOS, 30, EOS, 40, 41, 42, 43, EOS, 50, 51]
    starts = [0, 3, 7, 9, 14]
    mask = [1] * 16
    mask[3] = mask[4] = 0  # a prompt of two tokens
    c = data.Corpus(torch.tensor(tokens), np.array(starts), np.array(mask, np.uint8))
    seq = 6
    x, y, d = data.document_batch(c, step=3, batch=32, seq=seq, seed=7)
    assert x.shape == y.shape == d.shape == (32, seq)
    assert x.dtype == y.dtype == d.dtype == torch.int64
    x2, y2, d2 = data.document_batch(c, step=3, batch=32, seq=seq, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(d, d2)
    assert not torch.equal(x, data.document_batch(c, step=4, batch=32, seq=seq, seed=7)[0])
    sx, sy = data.global_batch(c.tokens, 3, 32, seq, 7)  # the stream's windows, its targets
    assert torch.equal(x, sx) and ((y == sy) | (y == -100)).all()
    seen = set()
    for r in range(32):  # a row starts anywhere (mid-document too): find it in the tokens
        s = next(
            s
            for s in range(len(tokens) - seq)
            if tokens[s : s + seq + 1] == [*x[r].tolist(), int(sy[r, -1])]
        )
        seen.add(s)
        ex, ey, ed = _expected(tokens, starts, mask, s, seq)
        assert x[r].tolist() == ex and y[r].tolist() == ey and d[r].tolist() == ed
    assert len(seen) > 3 and not seen <= set(starts)  # windows that start mid-document


def test_document_batch_needs_enough_tokens():
    c = data.Corpus(torch.arange(8), np.array([0, 5]))
    x, y, d = data.document_batch(c, 0, 4, 6, 0)  # only the window at 0 fits
    assert (x[:, 0] == 0).all() and (d[:, 5] == 1).all() and (y[:, 4] == -100).all()
    with pytest.raises(ValueError, match="fewer than seq_len"):
        data.document_batch(c, 0, 4, 7, 0)
