"""The trainer's metrics: the JSONL schema of --metrics-file (one object per logged step), the
FLOPs per token counted by hand (6 N + 12 L H Q S), MFU only where a peak is known or given,
memory labelled with what it measures, the progress line's timestamp / elapsed / ETA, and
TensorBoard scalars (or a clear error without the package)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch
from _flags import ONE_RANK, tiny_config
from _model_runs import mla_sizes
from _no_ranks import forbid_ranks

from fastpar.models import build_model
from fastpar.train import TrainConfig, launch, main, metrics
from fastpar.train.metrics import metrics_row

#: 2 ranks (dp 2), dense, a step in milliseconds
TINY = tiny_config(
    ONE_RANK, dp=2, steps=4, log_every=2, warmup=0, lr_schedule="constant", quiet=None
)
KEYS = {
    "step",
    "steps",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "flops_per_token",
    "mfu",
    "mem_kind",
    "mem_mib",
    "mem_reserved_mib",
    "skipped",
    "skipped_steps",
    "time",
    "elapsed_s",
    "eta_s",
    "rank_step_s",
    "rank_wait_s",
    "slowest_rank",
    "straggle",
}


def _flops_by_hand(cfg: TrainConfig) -> float:
    """6 N + 12 L H Q S, N: every distinct parameter of the single-process model but the token
    and position tables, plus the tied LM head's vocab x hidden matmul."""
    blocks = build_model(cfg.model, None)
    params = {id(p): p for b in blocks for p in b.parameters()}
    total = sum(p.numel() for p in params.values())
    tables = blocks[0].tok.weight.numel() + blocks[0].pos.weight.numel()
    n = total - tables + cfg.vocab * cfg.model.hidden  # tied: the head reuses the token table
    return (
        6 * n
        + 12
        * cfg.model.layers
        * cfg.model.heads
        * (cfg.model.hidden // cfg.model.heads)
        * cfg.model.seq_len
    )


def test_jsonl_schema_and_numbers(tmp_path, capfd):
    path = tmp_path / "run.jsonl"
    cfg = TrainConfig.from_flags(**TINY, metrics_file=str(path), peak_tflops=2.0)
    before = time.time()
    records = launch(cfg)
    out = capfd.readouterr().out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]  # logged steps only (--log-every 2, the last)
    by_step = {r["step"]: r for r in records}
    for row in rows:
        assert set(row) == KEYS
        assert row["steps"] == 4 and row["skipped"] is False and row["skipped_steps"] == 0
        assert row["loss"] == by_step[row["step"]]["loss"] and math.isfinite(row["loss"])
        assert row["lr"] == pytest.approx(cfg.lr) and row["grad_norm"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 * row["tokens_per_s_per_device"])
        assert row["flops_per_token"] == _flops_by_hand(cfg)
        peak = 2.0e12 * 2  # --peak-tflops 2 on each of the 2 ranks
        assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tokens_per_s"] / peak)
        assert row["mem_kind"] == "rss" and row["mem_reserved_mib"] is None
        assert 50 < row["mem_mib"] < 1e5  # the process's peak RSS, torch included
        assert before <= row["time"] <= time.time()
    assert 0 < rows[0]["elapsed_s"] < rows[1]["elapsed_s"]
    assert rows[0]["eta_s"] > 0 and rows[1]["eta_s"] == 0
    # the progress line: a timestamp, memory with its kind, MFU, elapsed and ETA
    lines = [ln for ln in out.splitlines() if "step    " in ln]
    assert len(lines) == 2, out
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \["
    for line in lines:
        assert re.match(stamp, line), line
        assert "MiB RSS (peak/rank)" in line and "MFU " in line
        assert re.search(r"elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d", line), line


def test_a_resumed_run_appends_and_a_fresh_one_starts_afresh(tmp_path):
    path, ckpt = tmp_path / "run.jsonl", tmp_path / "ckpt"
    common = dict(TINY, log_every=1, metrics_file=str(path), checkpoint_dir=str(ckpt), quiet=True)
    launch(TrainConfig.from_flags(**{**common, "steps": 2}))
    launch(TrainConfig.from_flags(**{**common, "steps": 3}, resume=True))
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    path.write_text('{"step": 99}\n')
    launch(
        TrainConfig.from_flags(**{**common, "steps": 1, "checkpoint_dir": str(tmp_path / "other")})
    )
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1]


def test_mfu_needs_a_known_or_given_peak(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert metrics.mfu(1e4, 10**9, cpu, 8) is None  # a CPU: no guess
    assert metrics.mfu(1e4, 0, cpu, 4, flops_per_token=2e9, peak_tflops=0.5) == pytest.approx(
        2e9 * 1e4 / (4 * 0.5e12)
    )
    for name, peak in [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        got = metrics.mfu(1e4, 0, gpu, 2, flops_per_token=3e9)
        assert got == pytest.approx(3e9 * 1e4 / (2 * peak)), name
        given = metrics.mfu(1e4, 0, gpu, 2, flops_per_token=3e9, peak_tflops=100.0)
        assert given == pytest.approx(3e9 * 1e4 / (2 * 100e12))  # --peak-tflops wins
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert metrics.mfu(1e4, 10**9, gpu, 2) is None


def test_flops_count_llama_gqa_and_moe_by_hand():
    """A Llama with its own head width, untied, with MoE blocks: only top_k / experts of the
    experts count, the router in full; no embedding table; the untied head in full."""
    width = dict(hidden=32, heads=4, head_dim=16, kv_heads=2)
    moe = dict(moe_every=2, experts=4, top_k=1)
    cfg = TrainConfig.from_flags(
        model_type="llama", **width, layers=2, **moe, untied=True, seq_len=16
    )
    blocks = build_model(cfg.model, None)
    params = {id(p): p for b in blocks for p in b.parameters()}
    moe = blocks[2].mlp
    experts = sum(p.numel() for n, p in moe.named_parameters() if not n.startswith("router"))
    n = sum(p.numel() for p in params.values()) - blocks[0].tok.weight.numel() - experts * 3 / 4
    counts = {
        "total": sum(p.numel() for p in params.values()),
        "embedding": blocks[0].tok.weight.numel(),
        "experts": experts,
    }
    assert metrics.flops_per_token(cfg, counts) == 6 * n + 12 * 2 * 4 * 16 * 16


MTP_MODELS = {
    # tied; the MTP block (layer 2) a MoE block (every 3rd), the main blocks dense
    "llama": dict(model_type="llama", kv_heads=2, head_dim=6, moe_every=3, experts=4, top_k=2),
    "llama-untied": dict(model_type="llama", kv_heads=2, head_dim=6, moe_every=0, untied=True),
    # latent attention, the MTP block MoE with a shared expert; untied
    "deepseek": dict(
        model_type="deepseek", experts=4, top_k=2, moe_ffn=8, shared_expert_ffn=16, untied=True
    )
    | mla_sizes(10, 12, 4, 6, 5),
}


@pytest.mark.parametrize("model", list(MTP_MODELS))
def test_flops_count_one_mtp_module_by_hand(model):
    """--mtp-depth 1 adds to 6 N + 12 L H Q S what one more layer adds, written here from the
    dims: its parameters (enorm, hnorm, eh_proj 2H -> H, the block, its final norm; of routed
    experts top_k of them), the shared head's vocab x H matmul of its logits, and one more
    layer of attention."""
    dims = dict(hidden=32, heads=4, layers=2, seq_len=16, vocab_size=256, **MTP_MODELS[model])
    cfgs = [TrainConfig.from_flags(**dims, mtp_depth=d) for d in (0, 1)]
    flops = [metrics.flops_per_token(c, _counts(c)) for c in cfgs]
    c, h, heads = cfgs[1], 32, 4
    if model.startswith("llama"):
        q = 6
        attention = h * q * (heads + 2 * 2) + heads * q * h  # q|k|v (2 kv heads), o
        ffn = 64 * math.ceil(8 * h / 3 / 64)  # SwiGLU's default width, also the experts'
        mlp = 3 * h * ffn if model == "llama-untied" else 4 * h + 2 * 3 * h * ffn
    else:
        q = (6 + 4 + 5) / 2  # scores over q/k heads of 10, values of 5
        q_low = h * 10 + 10 + 10 * heads * 10  # q_a, its norm, q_b (q/k heads of 10)
        kv_low = h * (12 + 4) + 12 + 12 * heads * (6 + 5)  # kv_a (+ rotary key), norm, kv_b
        attention = q_low + kv_low + heads * 5 * h  # and o
        mlp = 4 * h + 2 * 3 * h * 8 + 3 * h * 16  # router, top-2 experts of 8, shared of 16
    module = 3 * h + 2 * h * h + 2 * h + attention + mlp  # 3 norms, eh_proj, block norms
    assert flops[1] - flops[0] == 6 * (module + 256 * h) + 12 * heads * q * 16
    assert c.model.mtp_depth == 1 and _counts(c)["total"] > _counts(cfgs[0])["total"]


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_the_layouts_parameter_count_with_mtp_is_the_models(model):
    """At tp 2 x pp 2 with --mtp-depth 1 the parameters the ranks allocate, each counted once
    across the layout (``param_counts``: the header's count and the FLOPs' N), are the
    single-process model's: the last stage's copy of the embedding (the MTP lookups) is not
    counted twice, and the FLOPs per token are the single-process model's."""
    from fastpar.testing import run_ranks

    dims = dict(hidden=32, heads=4, layers=2, seq_len=16, **MTP_MODELS[model])
    cfg = TrainConfig.from_flags(**dims, tp=2, pp=2, dp=1, ep=1, mtp_depth=1, quiet=True)
    cfg.check()
    got = run_ranks(_layout_counts, 4, cfg)
    counts = got[0][0]
    assert all(c == counts for c, _ in got), got
    assert [mtp > 0 for _, mtp in got] == [False, False, True, True]  # the last stage's
    assert counts == _counts(cfg), (counts, _counts(cfg))
    assert metrics.flops_per_token(cfg, counts) == metrics.flops_per_token(cfg, _counts(cfg))


@pytest.mark.parametrize("zero", [1, 3])
def test_the_counted_parameters_under_zero_are_the_models(zero):
    """At dp 2 x pp 2 the header's count is the single-process model's under ZeRO-1 and under
    ZeRO-3 (whose parameters are empty between steps: counted gathered, not as 0)."""
    from fastpar.testing import run_ranks

    cfg = TrainConfig.from_flags(
        model_type="llama", hidden=32, heads=4, layers=2, seq_len=16, tp=1, pp=2, dp=2
    )
    cfg = cfg.with_flags(ep=1, zero=zero, moe_every=0, quiet=True)
    cfg.check()
    got = run_ranks(_zero_counts, 4, cfg)
    assert all(c == got[0][0] for c, _ in got), got
    assert got[0][0] == _counts(cfg), (got, _counts(cfg))
    assert all(held > 0 for _, held in got), got


def _zero_counts(cfg: TrainConfig):
    from fastpar import ParallelMesh
    from fastpar.train.build import Trainer
    from fastpar.train.loop import model_counts

    trainer = Trainer(cfg, ParallelMesh(cfg.tp, cfg.pp, cfg.ep), torch.device("cpu"))
    return model_counts(trainer)


def _layout_counts(cfg: TrainConfig) -> dict[str, int]:
    from fastpar import ParallelMesh
    from fastpar.train.build import Trainer

    trainer = Trainer(cfg, ParallelMesh(cfg.tp, cfg.pp, cfg.ep), torch.device("cpu"))
    mtp = sum(p.numel() for n, p in trainer.named_parameters().items() if ".mtp." in n)
    return metrics.param_counts(trainer.stage_module, trainer.mesh, trainer.device), mtp


def _counts(cfg: TrainConfig) -> dict[str, int]:
    """``metrics.param_counts`` of the single-process model, without a process group."""
    from fastpar.mesh.placement import is_expert
    from fastpar.moe import moe_layers

    blocks = build_model(cfg.model, None)
    params = {id(p): p for b in blocks for p in b.parameters()}
    experts = {id(p) for b in blocks for m in moe_layers(b) for p in m.parameters() if is_expert(p)}
    return {
        "total": sum(p.numel() for p in params.values()),
        "embedding": blocks[0].tok.weight.numel(),
        "experts": sum(params[i].numel() for i in experts),
    }


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, path = tmp_path / "tb", tmp_path / "run.jsonl"
    launch(TrainConfig.from_flags(**TINY, tensorboard=str(tb), metrics_file=str(path), quiet=True))
    acc = EventAccumulator(str(tb))
    acc.Reload()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows])
    assert "train/tokens_per_s" in acc.Tags()["scalars"]
    assert "train/mfu" not in acc.Tags()["scalars"]  # a CPU without --peak-tflops: none


def test_missing_tensorboard_is_one_clear_error(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    forbid_ranks(monkeypatch)
    argv = ["--tp", "1", "--pp", "1", "--dp", "1", "--ep", "1", "--tensorboard", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --tensorboard") and "pip install fastpar[tensorboard]" in err
    assert len(err.splitlines()) == 1


def test_fastpar_imports_without_tensorboard():
    """``import fastpar`` (and the trainer) never needs the tensorboard package; opening a
    writer without it names the extra to install."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'tensorboard': raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fastpar, fastpar.train, fastpar.train.metrics as m\n"
        "try:\n"
        "    m.open_tensorboard('unused')\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "pip install fastpar[tensorboard]" in out.stdout


def test_eta_leaves_the_compile_step_out():
    cfg = TrainConfig.from_flags(steps=10, batch_size=2, seq_len=8)
    import torch

    def row(step, elapsed, **kw):
        rec = {"step": step, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "skipped": False}
        return metrics_row(
            cfg,
            [rec],
            seconds=1.0,
            elapsed=elapsed,
            steps_run=step,
            flops=1.0,
            device=torch.device("cpu"),
            mem=(1.0, None),
            skipped_steps=0,
            **kw,
        )

    assert row(2, 101.0)["eta_s"] == pytest.approx(101.0 / 2 * 8)  # without --compile
    assert row(1, 100.0, compile_s=100.0, compile_steps=1)["eta_s"] is None  # no rate yet
    assert row(2, 101.0, compile_s=100.0, compile_steps=1)["eta_s"] == pytest.approx(8.0)
