"""Training data: text (bytes or tokenizer ids), .npy and memory-mapped .bin token files, the
vocabulary check before any rank starts, the tokenizer command, and fastpar without the
Hugging Face libraries."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from fastpar import data
from fastpar.tokenizer import main as tokenizer_main

SMALL_RUN = ["--tp", "1", "--pp", "1", "--dp", "1", "--ep", "1", "--moe-every", "0", "--steps", "1"]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_files_are_memory_mapped_and_batches_are_windows_of_them(tmp_path, dtype):
    top = 70_000 if dtype == "uint32" else 60_000  # uint32: ids past 65535 survive
    ids = np.arange(top - 5000, top, dtype=dtype)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    tokens = data.load_tokens(str(path), dtype=dtype)
    assert isinstance(tokens, np.memmap)
    assert np.array_equal(np.asarray(tokens), ids)
    x, y = data.global_batch(tokens, step=3, batch=4, seq=16, seed=1)
    assert x.dtype == y.dtype == torch.int64 and x.shape == (4, 16)
    # consecutive ids: each row is a window of the file, the target is the next id
    assert torch.equal(y, x + 1)
    assert torch.all(x[:, 1:] - x[:, :-1] == 1)
    assert int(x.min()) >= top - 5000 and int(y.max()) < top
    # the same batch as from the ids held in memory: data source does not change the stream
    xt, yt = data.global_batch(torch.from_numpy(ids.astype(np.int64)), 3, 4, 16, 1)
    assert torch.equal(x, xt) and torch.equal(y, yt)


def test_npy_files(tmp_path):
    ids = np.array([[5, 1, 7], [2, 9, 3]], dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    tokens = data.load_tokens(str(tmp_path / "ids.npy"))
    assert np.array_equal(np.asarray(tokens), [5, 1, 7, 2, 9, 3])
    np.save(tmp_path / "f.npy", np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"holds float32 values, not integer token ids"):
        data.load_tokens(str(tmp_path / "f.npy"))


def test_text_is_bytes_without_a_tokenizer(tmp_path):
    text = "héllo, wörld\n"
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    tokens = data.load_tokens(str(tmp_path / "t.txt"))
    assert tokens.tolist() == list(text.encode("utf-8"))


def test_bad_files_are_refused_with_the_fix(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(
        ValueError, match=r"3 bytes, not a whole number of uint16 ids.*--data-dtype"
    ):
        data.load_tokens(str(odd))
    with pytest.raises(ValueError, match=r"data dtype must be one of \['uint16', 'uint32'\]"):
        data.load_tokens(str(odd), dtype="int8")
    with pytest.raises(ValueError, match=r"data file '.*missing.bin' does not exist"):
        data.load_tokens(str(tmp_path / "missing.bin"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text \(bad byte at offset 3\)"):
        data.load_tokens(str(tmp_path / "latin1.txt"), tokenizer=str(tmp_path / "none.json"))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    pytest.importorskip("tokenizers")
    out = tmp_path_factory.mktemp("tok") / "tok.json"
    assert tokenizer_main(["--vocab-size", "300", "--out", str(out)]) == 0
    return str(out)


def test_tokenizer_command_trains_a_byte_level_bpe(tokenizer_file, tmp_path, capsys):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(tokenizer_file)
    assert tok.get_vocab_size() == 300
    assert tok.token_to_id("<|endoftext|>") is not None
    for text in ["def __init__(self):\n    return x", "naïve café — 日本語 🙂", "\x00\x7f"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text  # byte level: every text round-trips, nothing unknown
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc abd abe " * 50)
    assert tokenizer_main(["--vocab-size", "5000", "--out", str(tmp_path / "t.json"),
                           "--data", str(corpus)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "the corpus allowed" in out and "wrote" in out  # too little text for 5000 tokens
    assert tokenizer_main(["--vocab-size", "200", "--out", str(tmp_path / "x.json")]) == 2
    assert "use --vocab-size 257 or more" in capsys.readouterr().err


def test_text_with_a_tokenizer_encodes_as_the_library_does(tokenizer_file, tmp_path):
    import tokenizers

    text = data.embedded_corpus().decode()
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    want = tokenizers.Tokenizer.from_file(tokenizer_file).encode(text, add_special_tokens=False)
    for source in (str(path), None):  # a text file, or the embedded corpus
        got = data.load_tokens(source, tokenizer=tokenizer_file)
        assert got.tolist() == want.ids  # chunked encoding equals the whole-text encoding
    assert data.tokenizer_vocab_size(tokenizer_file) == 300
    with pytest.raises(ValueError, match=r"python -m fastpar.tokenizer --vocab-size 512"):
        data.load_tokenizer(str(tmp_path / "absent.json"))


def _no_ranks(*args, **kwargs):
    raise AssertionError("a rank was started before the data were checked")


@pytest.mark.parametrize("command", ["train", "verify"])
def test_out_of_vocabulary_ids_fail_before_any_rank_starts(command, tmp_path, monkeypatch, capsys):
    import fastpar.testing
    from fastpar import train, verify

    monkeypatch.setattr(fastpar.testing, "run_ranks", _no_ranks)
    main = train.main if command == "train" else verify.main
    ids = np.full(1000, 7, dtype=np.uint16)
    ids[123] = 300
    path = tmp_path / "train.bin"
    ids.tofile(path)
    assert main([*SMALL_RUN, "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for part in (
        str(path), "the largest token id is 300", "the vocabulary has 256 tokens",
        "pass --vocab-size 301 or more", "read as uint16",
    ):  # fmt: skip
        assert part in err, err
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([1, 2, -4, 3] * 100, dtype=np.int64))
    assert main([*SMALL_RUN, "--data", str(neg)]) == 2
    assert "neg.npy: token id -4 is negative" in capsys.readouterr().err
    short = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)
    assert main([*SMALL_RUN, "--data", str(short)]) == 2
    assert "10 tokens, fewer than the 66 one sequence needs" in capsys.readouterr().err


def test_vocab_size_follows_the_tokenizer(tokenizer_file, capsys):
    from fastpar.train import TrainConfig, main

    cfg = TrainConfig(model_type="llama", tokenizer=tokenizer_file)
    assert cfg.model().vocab_size == 300
    assert TrainConfig(tokenizer=tokenizer_file, vocab_size=320).model().vocab_size == 320
    assert main([*SMALL_RUN, "--tokenizer", tokenizer_file, "--vocab-size", "299"]) == 2
    assert "--vocab-size 299 is smaller than the 300 tokens of" in capsys.readouterr().err


def test_fastpar_needs_no_hugging_face_library():
    code = textwrap.dedent(
        """
        import sys
        BLOCKED = ("transformers", "tokenizers", "safetensors")
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{name} blocked for this test")
        sys.meta_path.insert(0, Block())
        import torch
        import fastpar, fastpar.train, fastpar.verify, fastpar.data, fastpar.tokenizer
        from fastpar.models import GPTConfig, LlamaConfig, build_gpt, build_llama, to_hf
        from fastpar.data import global_batch, load_tokens
        x, _ = global_batch(load_tokens(), 0, 2, 16, 0)
        for blocks in (build_gpt(GPTConfig(seq_len=16, layers=1)),
                       build_llama(LlamaConfig(seq_len=16, layers=1))):
            assert torch.nn.Sequential(*blocks)(x).shape == (32, 256)
        try:
            load_tokens(None, tokenizer="tok.json")
        except ImportError as exc:
            print(exc)
        one_rank = ["--tp", "1", "--pp", "1", "--dp", "1", "--ep", "1", "--moe-every", "0"]
        print(fastpar.train.main([*one_rank, "--steps", "1", "--layers", "1", "--quiet"]))
        print(fastpar.train.main(["--tokenizer", "tok.json"]))
        print(fastpar.tokenizer.main(["--vocab-size", "300", "--out", "t.json"]))
        print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "needs the Hugging Face `tokenizers` library: pip install fastpar[hf]" in lines[0]
    assert lines[1:] == ["0", "2", "2", "[]"]  # a GPT trained; the tokenizer paths refused
    assert out.stderr.count("pip install fastpar[hf]") == 2
