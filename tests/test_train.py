"""The training and verify commands end to end: several layouts on 8 CPU ranks, verify over a
matrix of layouts, resume after an interruption, profiling, and the CLI's errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _flags
import pytest
from _flags import ONE_RANK, tiny_config
from _no_ranks import forbid_ranks

from fastpar.train import TrainConfig, launch, main
from fastpar.verify import compare

SMALL = tiny_config(steps=4, seq_len=32)
#: the command-line runs' length and model (the rest the defaults)
CLI_RUN = dict(steps=3, batch_size=8, seq_len=32, layers=2)


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, dp=2, ep=2, zero=1),
        dict(tp=1, pp=4, dp=2, ep=1, moe_every=0, zero=2, schedule="gpipe", microbatches=4),
        dict(tp=4, pp=1, dp=2, ep=2, zero=0, precision="bf16"),
        dict(tp=2, pp=1, dp=4, ep=4, zero=3, experts=4),
        dict(tp=2, pp=2, dp=2, ep=2, zero=1, model_type="llama", kv_heads=2, qk_norm=True),
    ],
    ids=["dp2-tp2-pp2-ep2-z1", "pp4-dp2-gpipe-z2", "tp4-dp2-ep2-bf16", "tp2-dp4-ep4-z3", "llama"],
)
def test_training_runs_and_the_loss_falls(layout):
    cfg = TrainConfig.from_flags(**{**SMALL, "steps": 8, **layout})
    records = launch(cfg)
    assert len(records) == 8
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN
    assert records[-1]["loss"] < records[0]["loss"]


VERIFY = [
    dict(tp=2, pp=2, dp=2, ep=2, zero=1),
    dict(tp=2, pp=2, dp=2, ep=2, zero=0, schedule="gpipe", recompute=True),
    dict(tp=2, pp=1, dp=4, ep=2, zero=2, capacity_factor=2.0, overlap_chunks=2),
    dict(tp=1, pp=1, dp=4, ep=4, zero=3),
    dict(tp=4, pp=2, dp=1, ep=1, moe_every=0, zero=1, sequence_parallel=True),
    dict(tp=2, pp=2, dp=2, ep=1, moe_every=0, zero=2, untied=True, precision="bf16"),
    dict(tp=2, pp=2, dp=2, ep=2, zero=1, precision="fp16"),
]


# VERIFY[0, 1, 6] (tp 2 x pp 2 x dp 2 x ep 2: ZeRO-1, GPipe with recompute, fp16):
# tests/test_verify_matrix.py
@pytest.mark.parametrize("i", [2, 3, 4, 5], ids=str)
def test_verify_agrees_with_single_process(i):
    cfg = TrainConfig.from_flags(**{**SMALL, "steps": 3, **VERIFY[i]})
    ok, text = compare(cfg)
    assert ok, text
    assert "AGREE" in text.splitlines()[-1]


# the Llama over the same layouts: GQA everywhere, Qwen3 q/k-norm and Qwen2 q/k/v bias in turn
# (a q/k-norm gradient left partial over TP, or a wrong key/value head split, shows in the
# parameters after the steps)
LLAMA = dict(model_type="llama", kv_heads=2, ffn=48)
LLAMA_VARIANTS = [
    dict(qk_norm=True),
    dict(attention_bias=True, rope_theta=5e5),
    dict(qk_norm=True),
    dict(attention_bias=True),
    dict(qk_norm=True, attention_bias=True, heads=8, kv_heads=4),  # tp 4: 4 key/value heads
    dict(qk_norm=True, head_dim=12),
    dict(attention_bias=True),
]


@pytest.mark.parametrize("i", range(1, len(VERIFY)), ids=str)  # (0: the matrix's llama cases)
def test_llama_verify_agrees_with_single_process(i):
    cfg = TrainConfig.from_flags(**{**SMALL, "steps": 3, **VERIFY[i], **LLAMA, **LLAMA_VARIANTS[i]})
    ok, text = compare(cfg)
    assert ok, text
    assert text.splitlines()[0].startswith("llama, layout")


def test_resume_after_interruption_is_bit_identical(tmp_path):
    base = dict(SMALL, tp=2, pp=2, dp=2, ep=2, zero=1, steps=6)
    full = launch(TrainConfig.from_flags(**base))
    ckpt = str(tmp_path / "ckpt")
    # "interrupted" after step 4: the run ends there (its ranks exit), a new run resumes
    first = launch(
        TrainConfig.from_flags(**{**base, "steps": 4, "checkpoint_dir": ckpt, "save_every": 2})
    )
    resumed = launch(TrainConfig.from_flags(**{**base, "checkpoint_dir": ckpt, "resume": True}))
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in first] == [r["loss"] for r in full[:4]]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:]]


def test_resume_skips_a_half_written_checkpoint(tmp_path):
    base = dict(SMALL, tp=1, pp=1, dp=2, ep=1, moe_every=0, zero=0, steps=4)
    ckpt = tmp_path / "ckpt"
    launch(TrainConfig.from_flags(**{**base, "checkpoint_dir": str(ckpt), "save_every": 2}))
    # a crash while saving step 4 left a directory without its completion marker
    (ckpt / "step_000004" / "COMPLETE").unlink()
    resumed = launch(
        TrainConfig.from_flags(**{**base, "checkpoint_dir": str(ckpt), "resume": True})
    )
    assert [r["step"] for r in resumed] == [3, 4]


def test_profile_writes_chrome_traces(tmp_path):
    out = tmp_path / "prof"
    launch(
        TrainConfig.from_flags(
            **{
                **SMALL,
                "tp": 1,
                "pp": 2,
                "dp": 1,
                "ep": 1,
                "moe_every": 0,
                "steps": 2,
                "profile": str(out),
            }
        )
    )
    traces = sorted(os.listdir(out))
    assert traces == ["trace_rank0.json", "trace_rank1.json"]
    doc = json.loads((out / traces[0]).read_text())
    assert doc["traceEvents"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tp", "3"], "heads 4 are not divisible by tp 3"),
        (
            ["--ep", "4"],
            "data-parallel size 2 (= world_size 8 / (tp*pp = 4)) is not divisible by ep 4",
        ),
        (["--tp", "4", "--heads", "6", "--hidden", "48"], "heads 6 are not divisible by tp 4"),
        (["--batch-size", "6"], "batch_size 6 must split into dp=2 replicas of 2 micro-batches"),
        (
            ["--pp", "8", "--dp", "1", "--ep", "1", "--layers", "2"],
            "the model has 4 pipeline blocks",
        ),
        (
            ["--ep", "3", "--dp", "3", "--batch-size", "6", "--microbatches", "1"],
            "num_experts 4 is not divisible by ep 3",
        ),
        (["--precision", "fp4"], "precision must be fp32, bf16, fp16 or fp8"),
        (["--qk-norm"], "--qk-norm is a Llama option: add --model llama"),
        (["--kv-heads", "2"], "--kv-heads is a Llama option: add --model llama"),
        (["--model", "bert"], "model must be gpt, llama or deepseek, got 'bert'"),
        (["--model", "llama", "--norm", "layernorm"], "--norm layernorm is a GPT option"),
        (
            ["--model", "llama", "--kv-heads", "2", "--tp", "4", "--pp", "1"],
            "kv_heads 2 are not divisible by tp 4",
        ),
        (["--model", "llama", "--kv-heads", "3"], "kv_heads 3 must divide heads 4"),
        (["--kv-lora-rank", "8"], "--kv-lora-rank is a DeepSeek option: add --model deepseek"),
        (
            ["--model", "deepseek", "--cp", "2", "--cp-attention", "all-to-all", "--heads", "2"],
            "--cp-attention all-to-all scatters this rank's 1 query heads",
        ),
        (["--model", "deepseek", "--norm", "layernorm"], "the DeepSeek uses RMSNorm"),
        (["--data-dtype", "int8"], "data_dtype must be one of ['uint16', 'uint32']"),
    ],
)
def test_cli_errors(argv, message, capsys, monkeypatch):
    forbid_ranks(monkeypatch)  # every error comes before any rank starts
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_verify_cli_exit_codes():
    layout = dict(ONE_RANK, tp=2, dp=2)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastpar.verify",
            *_flags.argv(**layout, steps=2, layers=2, hidden=32, batch_size=8),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("AGREE")
    bad = subprocess.run(
        [sys.executable, "-m", "fastpar.verify", "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "error:" in bad.stderr


def test_zero3_resume_is_bit_identical(tmp_path):
    base = dict(SMALL, tp=1, pp=1, dp=2, ep=2, zero=3, steps=4)
    full = launch(TrainConfig.from_flags(**base))
    ckpt = str(tmp_path / "ckpt")
    launch(TrainConfig.from_flags(**{**base, "steps": 2, "checkpoint_dir": ckpt, "save_every": 2}))
    resumed = launch(TrainConfig.from_flags(**{**base, "checkpoint_dir": ckpt, "resume": True}))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]


def test_data_file_and_global_parameter_count(tmp_path, capfd):
    import torch

    from fastpar.models.gpt import build_gpt

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = _flags.argv(data=str(text), **CLI_RUN)
    assert main(args) == 0
    out = capfd.readouterr().out  # the ranks are forked processes: capture file descriptors
    cfg = TrainConfig.from_flags(layers=2, seq_len=32)
    model = torch.nn.Sequential(*build_gpt(cfg.model))
    n = sum(p.numel() for p in model.parameters())
    assert f"{n:,} parameters" in out  # counted once across dp x tp x pp x ep
    assert "step    3/3" in out


@pytest.mark.slow
def test_training_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    out = subprocess.run(
        [*torchrun, "4", "-m", "fastpar.train", *_flags.argv(tp=2, pp=1, dp=2, ep=2, **CLI_RUN)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world 4 = dp 2 x tp 2 x pp 1 (ep 2)" in out.stdout
    assert "step    3/3" in out.stdout


def test_mfu_arithmetic(monkeypatch):
    import torch

    from fastpar.train import metrics

    assert metrics.mfu(1000.0, 10**9, torch.device("cpu"), 8) is None  # CPUs: not reported
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    # 6 FLOPs / parameter / token: 6e9 * 1e4 tokens/s over 2 GPUs of 989 TFLOP/s
    got = metrics.mfu(1e4, 10**9, torch.device("cuda", 0), 2)
    assert got == pytest.approx(6e9 * 1e4 / (2 * 989e12))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert metrics.mfu(1e4, 10**9, torch.device("cuda", 0), 2) is None


def test_llama_on_tokenizer_ids_from_a_bin_file(tmp_path, capfd):
    tokenizers = pytest.importorskip("tokenizers")
    import numpy as np
    import torch

    from fastpar.data import embedded_corpus
    from fastpar.models import LlamaConfig, build_llama
    from fastpar.tokenizer import main as tokenizer_main

    tok = str(tmp_path / "tok.json")
    assert tokenizer_main(["--vocab-size", "300", "--out", tok]) == 0
    ids = tokenizers.Tokenizer.from_file(tok).encode(embedded_corpus().decode()).ids
    np.array(ids, dtype=np.uint16).tofile(tmp_path / "train.bin")
    data = str(tmp_path / "train.bin")
    args = _flags.argv(model_type="llama", kv_heads=2, qk_norm=True, tokenizer=tok, data=data)
    args += _flags.argv(**CLI_RUN)
    assert main(args) == 0
    out = capfd.readouterr()
    sizes = dict(vocab_size=300, seq_len=32, hidden=64, heads=4, kv_heads=2, layers=2)
    model = LlamaConfig(**sizes, qk_norm=True, tie_embeddings=True, moe_every=2)
    n = sum(p.numel() for p in torch.nn.Sequential(*build_llama(model)).parameters())
    assert "llama, world 8 = dp 2 x tp 2 x pp 2 (ep 2)" in out.out
    assert f"{n:,} parameters" in out.out  # a 300-token vocabulary: the tokenizer's
    assert "step    3/3" in out.out
    assert "huggingface/tokenizers" not in out.err  # no fork-after-parallelism warning
    # the same tokenizer on the text itself, proven equal to the single-process model
    (tmp_path / "corpus.txt").write_text(embedded_corpus().decode())
    cfg = TrainConfig.from_flags(
        **{**SMALL, "steps": 2, **LLAMA, "tp": 2, "pp": 1, "dp": 2, "ep": 2},
        tokenizer=tok,
        data=str(tmp_path / "corpus.txt"),
    )
    ok, text = compare(cfg)
    assert ok, text


def test_the_last_step_is_always_saved(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = dict(SMALL, tp=1, pp=1, dp=2, ep=1, moe_every=0, steps=3)
    launch(TrainConfig.from_flags(**cfg, checkpoint_dir=str(ckpt)))  # no --save-every
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("step_")) == ["step_000003"]
    launch(
        TrainConfig.from_flags(
            **{**cfg, "steps": 5}, checkpoint_dir=str(tmp_path / "b"), save_every=2
        )
    )
    saved = sorted(n for n in os.listdir(tmp_path / "b") if n.startswith("step_"))
    assert saved == ["step_000002", "step_000004", "step_000005"]


def test_the_cosine_floor_follows_the_learning_rate():
    from fastpar.train import lr_at

    cfg = TrainConfig.from_flags(lr=1e-4, warmup=0, steps=10)
    assert lr_at(cfg, 10) == pytest.approx(1e-5)  # lr / 10 at the end
    assert lr_at(
        TrainConfig.from_flags(lr=1e-4, min_lr=0.0, warmup=0, steps=10), 10
    ) == pytest.approx(0.0)
    assert lr_at(TrainConfig.from_flags(), 10**6) == pytest.approx(
        3e-4
    )  # the old default: 3e-3 / 10
