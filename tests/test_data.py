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
from _flags import ONE_RANK, argv
from _no_ranks import forbid_ranks

from fastpar import data
from fastpar.tokenizer import main as tokenizer_main

SMALL_RUN = argv(**ONE_RANK, steps=1)  # the default model


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
    ids = np.array([5, 1, 7, 2, 9, 3], dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    tokens = data.load_tokens(str(tmp_path / "ids.npy"))
    assert isinstance(tokens, np.memmap) and np.array_equal(np.asarray(tokens), ids)
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


def _object_npy(path):
    np.save(path, np.array([1, "a"], dtype=object), allow_pickle=True)


def _wide_bin(path):  # uint32 ids, to be read as uint16
    (np.arange(1000, dtype=np.uint32) % 200).tofile(path)


#: a data file, how it is written, and the one-line error the command gives before any rank
BAD_DATA = [
    ("empty.txt", lambda p: p.write_bytes(b""), "empty.txt is empty (0 bytes): pass a text file"),
    ("empty.bin", lambda p: p.write_bytes(b""), "empty.bin is empty (0 bytes): pass a .bin file"),
    (
        "odd.bin",
        lambda p: p.write_bytes(b"\x01" * 1001),
        "odd.bin has 1001 bytes, not a whole number of uint16 ids (2 bytes each): pass the "
        "--data-dtype it was written with",
    ),
    (
        "wide.bin",
        _wide_bin,
        "wide.bin: every second uint16 id is 0, as when uint32 ids are read "
        "as uint16 (their high halves): pass --data-dtype uint32",
    ),
    (
        "rows.npy",
        lambda p: np.save(p, np.ones((20, 100), dtype=np.int32)),
        "rows.npy holds a 2-D array of shape (20, 100), not one stream of token ids: save a 1-D "
        "array",
    ),
    ("one.npy", lambda p: np.save(p, np.array(5)), "one.npy holds a 0-D array of shape ()"),
    (
        "float.npy",
        lambda p: np.save(p, np.arange(1000, dtype=np.float64) + 0.5),
        "float.npy holds float64 values, not integer token ids",
    ),
    (
        "objects.npy",
        _object_npy,
        "objects.npy is not a .npy array of token ids numpy can memory-map",
    ),
    (
        "text.npy",
        lambda p: p.write_text("not an array"),
        "text.npy is not a .npy array of token ids numpy can memory-map",
    ),
    ("folder", lambda p: p.mkdir(), "is a directory: pass one file of text or token ids"),
    (
        "short.txt",
        lambda p: p.write_text("hi"),
        "short.txt: 2 tokens, fewer than the 66 one sequence needs (seq_len + 2): use more data",
    ),
]


@pytest.mark.parametrize("name,write,message", BAD_DATA, ids=[b[0] for b in BAD_DATA])
def test_bad_data_is_refused_before_any_rank(name, write, message, tmp_path, monkeypatch, capsys):
    from fastpar.train import main

    forbid_ranks(monkeypatch)
    write(tmp_path / name)
    assert main([*SMALL_RUN, "--data", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_wide_bin_read_with_its_dtype_and_a_real_uint16_bin_pass(tmp_path):
    _wide_bin(tmp_path / "wide.bin")
    tokens = data.load_tokens(str(tmp_path / "wide.bin"), dtype="uint32")
    assert tokens.tolist() == [i % 200 for i in range(1000)]
    ids = np.arange(1000, dtype=np.uint16) % 200  # every second id is 0 in no chunk
    ids[1::2] = 0
    ids[-1] = 3  # but the last pair's is not: the check reads on to the last chunk
    data.check_bin_width(ids, "x.bin", chunk=64)
    with pytest.raises(ValueError, match=r"every second uint16 id is 0"):
        data.check_bin_width(ids[:-2], "x.bin", chunk=64)


@pytest.mark.parametrize("command", ["train", "verify"])
def test_a_vocabulary_past_uint16_needs_data_dtype_uint32(command, tmp_path, monkeypatch, capsys):
    """uint32 ids read as uint16 pass the vocabulary check (every half is < 65536 < vocab) and
    fool the width check (their high halves are not 0): such a vocabulary needs uint32 asked."""
    from fastpar import train, verify
    from fastpar.train.cli import build_parser, prepare

    forbid_ranks(monkeypatch)
    main = train.main if command == "train" else verify.main
    path = tmp_path / "wide.bin"
    ids = np.arange(60_000, 70_000, dtype=np.uint32)  # ids past 65535, of a 70,000 vocabulary
    ids.tofile(path)
    flags = [*SMALL_RUN, "--data", str(path), "--vocab-size", "70000"]
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for part in (str(path), "the vocabulary has 70000 tokens", "pass --data-dtype uint32"):
        assert part in err, err
    assert main([*flags, "--data-dtype", "uint16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for part in (
        str(path),
        "--data-dtype uint16 cannot hold the ids of a 70000-token",
        "(up to 69999; uint16 ends at 65535)",
        "pass --data-dtype uint32",
    ):
        assert part in err, err
    cfg, tokens = prepare(build_parser().parse_args([*flags, "--data-dtype", "uint32"]))
    assert cfg.data_dtype == "uint32" and np.array_equal(np.asarray(tokens), ids)
    # a uint16 file of a small vocabulary needs no flag (uint16, as recorded); .npy and text
    # files of a large vocabulary need none either (their ids are not read as uint16)
    small = tmp_path / "small.bin"
    (np.arange(2000, dtype=np.uint16) % 512).tofile(small)
    cfg, tokens = prepare(
        build_parser().parse_args([*SMALL_RUN, "--data", str(small), "--vocab-size", "512"])
    )
    assert cfg.data_dtype == "uint16" and tokens.dtype == np.uint16
    np.save(tmp_path / "wide.npy", ids)
    text = tmp_path / "t.txt"
    text.write_text("some text " * 100)
    for other in (tmp_path / "wide.npy", text):
        cfg, _ = prepare(
            build_parser().parse_args([*SMALL_RUN, "--data", str(other), "--vocab-size", "70000"])
        )
        assert cfg.data_dtype is None
    # a size that is no whole number of the dtype's ids: refused, with either dtype
    (tmp_path / "odd.bin").write_bytes(b"\x01" * 4002)
    assert main([*SMALL_RUN, "--data", str(tmp_path / "odd.bin"), "--data-dtype", "uint32"]) == 2
    assert "odd.bin has 4002 bytes, not a whole number of uint32 ids (4 bytes each)" in (
        capsys.readouterr().err
    )


def test_a_missing_bin_file_is_missing_whatever_the_vocabulary(tmp_path, capsys):
    """The file's absence first: the uint32 rule for a vocabulary above 65,535 is about a file."""
    from fastpar.train import main

    missing = str(tmp_path / "missing.bin")
    for vocab in ("512", "70000"):
        assert main([*SMALL_RUN, "--data", missing, "--vocab-size", vocab]) == 2
        err = capsys.readouterr().err
        assert f"data file {missing!r} does not exist" in err and "uint32" not in err


def test_bin_dtype(tmp_path):
    assert data.bin_dtype(None, 65_536, "x.bin") == "uint16"  # ids 0..65535 fit
    assert data.bin_dtype("uint32", 512, "x.bin") == "uint32"
    with pytest.raises(ValueError, match=r"x\.bin: the vocabulary has 65537 tokens"):
        data.bin_dtype(None, 65_537, "x.bin")
    with pytest.raises(ValueError, match=r"data dtype must be one of"):
        data.bin_dtype("int8", 512, "x.bin")


def test_a_sequence_longer_than_the_data_is_refused(capsys, monkeypatch):
    from fastpar.train import main, memory

    forbid_ranks(monkeypatch)
    monkeypatch.setattr(memory, "_ram_available", lambda: 2**50)  # the data, not the memory
    n = len(data.load_tokens())  # the embedded corpus
    assert main([*SMALL_RUN, "--seq-len", str(n)]) == 2
    assert (
        f"the embedded corpus: {n} tokens, fewer than the {n + 2} one sequence needs "
        f"(seq_len + 2): use more data or --seq-len {n - 2} or less"
    ) in capsys.readouterr().err


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
    assert (
        tokenizer_main(
            ["--vocab-size", "5000", "--out", str(tmp_path / "t.json"), "--data", str(corpus)]
        )
        == 0
    )
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


@pytest.mark.parametrize("command", ["train", "verify"])
def test_out_of_vocabulary_ids_fail_before_any_rank_starts(command, tmp_path, monkeypatch, capsys):
    from fastpar import train, verify

    forbid_ranks(monkeypatch)
    main = train.main if command == "train" else verify.main
    ids = np.full(10_000, 7, dtype=np.uint16)  # one bad id among 10k, far from the start
    ids[9_876] = 300
    path = tmp_path / "train.bin"
    ids.tofile(path)
    assert main([*SMALL_RUN, "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for part in (
        str(path),
        "the largest token id is 300",
        "the vocabulary has 256 tokens",
        "pass --vocab-size 301 or more",
        "read as uint16",
    ):
        assert part in err, err
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([1, 2, -4, 3] * 100, dtype=np.int64))
    assert main([*SMALL_RUN, "--data", str(neg)]) == 2
    assert "neg.npy: token id -4 is negative" in capsys.readouterr().err
    short = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)
    assert main([*SMALL_RUN, "--data", str(short)]) == 2
    err = capsys.readouterr().err
    assert "10 tokens, fewer than the 66 one sequence needs (seq_len + 2): use more data" in err
    assert "or --seq-len 8 or less" in err


def test_vocab_size_follows_the_tokenizer(tokenizer_file, capsys):
    from fastpar.train import TrainConfig, main

    cfg = TrainConfig.from_flags(model_type="llama", tokenizer=tokenizer_file)
    assert cfg.model.vocab_size == 300
    assert TrainConfig.from_flags(tokenizer=tokenizer_file, vocab_size=320).model.vocab_size == 320
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
