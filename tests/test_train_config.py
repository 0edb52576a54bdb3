"""The training command's checks before any rank starts: every flag's range and words, the
flags that need --checkpoint-dir, the activation-memory estimate (against measured memory),
and under torchrun the --dp that follows WORLD_SIZE and the one-line world-size error whose
hint is itself a run that passes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from _flags import ONE_RANK, argv, tiny_argv
from _no_ranks import forbid_ranks

from fastpar.train import TrainConfig, build_parser, cli, config_from, launch, main, memory


def _refused(argv, capsys) -> str:
    """The one stderr line of a command refused with exit code 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    return err


FLAG_ERRORS = [
    (
        ["--lr-schedule", "linear"],
        "--lr-schedule 'linear' is not a schedule fastpar knows: pass one of cosine or constant",
    ),
    (["--save-every", "-1"], "--save-every -1 must be >= 0 (0: only the last step)"),
    (["--warmup", "-1"], "--warmup -1 must be >= 0 (0: no warm-up)"),
    (["--resume"], "--resume needs --checkpoint-dir DIR"),
    (["--save-every", "2"], "--save-every 2 needs --checkpoint-dir DIR"),
    (["--keep-last", "3"], "--keep-last 3 needs --checkpoint-dir DIR"),
    (["--allow-fresh"], "--allow-fresh needs --checkpoint-dir DIR"),
    (["--allow-other-run"], "--allow-other-run needs --checkpoint-dir DIR"),
    (["--allow-schedule-change"], "--allow-schedule-change needs --checkpoint-dir DIR"),
    (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["--seq-len", "0"], "--seq-len 0 must be >= 1"),
    (["--heads", "0"], "--heads 0 must be >= 1"),
    (["--hidden", "0"], "--hidden 0 must be >= 1"),
    (["--layers", "0"], "--layers 0 must be >= 1"),
    (["--log-every", "0"], "--log-every 0 must be >= 1"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--microbatches", "0"], "--microbatches 0 must be >= 1"),
    (["--tp", "0"], "--tp 0 must be >= 1"),
    (["--pp", "0"], "--pp 0 must be >= 1"),
    (["--dp", "0"], "--dp 0 must be >= 1"),
    (["--ep", "0"], "--ep 0 must be >= 1"),
    (["--experts", "0"], "--experts 0 must be >= 1"),
    (["--top-k", "0"], "--top-k 0 must be >= 1"),
    (["--top-k", "5"], "--top-k 5 exceeds --experts 4"),
    (["--moe-every", "-1"], "--moe-every -1 must be >= 0 (0: no MoE blocks)"),
    (["--overlap-chunks", "0"], "--overlap-chunks 0 must be >= 1"),
    (["--max-skipped-steps", "0"], "--max-skipped-steps 0 must be >= 1"),
    (["--ffn", "0"], "--ffn 0 must be >= 1"),
    (["--lr", "0"], "--lr 0 must be a positive finite number"),
    (["--lr", "-0.1"], "--lr -0.1 must be a positive finite number"),
    (["--lr", "nan"], "--lr nan must be a positive finite number"),
    (["--collective-timeout", "0"], "--collective-timeout 0 must be a positive finite number"),
    (["--collective-timeout", "-5"], "--collective-timeout -5 must be a positive finite number"),
    (["--collective-timeout", "inf"], "--collective-timeout inf must be a positive finite"),
    (["--max-grad-norm", "0"], "--max-grad-norm 0 must be a positive finite number"),
    (["--loss-scale", "0"], "--loss-scale 0 must be in [1, 2^40 = 1.1e+12]"),
    (["--loss-scale", "0.5"], "--loss-scale 0.5 must be in [1, 2^40"),
    (["--loss-scale", "1e39"], "--loss-scale 1e+39 must be in [1, 2^40"),
    (["--loss-scale", "2e12"], "every non-zero fp16 gradient overflows"),
    (["--collective-timeout", "1e12"], "--collective-timeout 1e+12 exceeds 1e+09 seconds"),
    (["--min-lr", "-1"], "--min-lr -1 must be a finite number >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be a finite number >= 0"),
    (
        ["--lr", "1e-4", "--min-lr", "3e-4"],
        "--min-lr 0.0003 is above --lr 0.0001: the cosine "
        "schedule would raise the rate; pass a --min-lr <= 0.0001",
    ),
    (["--capacity-factor", "0"], "--capacity-factor 0 must be a positive finite number"),
    (["--seed", str(2**60)], f"--seed {2**60} is out of range"),
    (["--model", "llama", "--rope-theta", "inf"], "--rope-theta inf must be a finite number"),
]


@pytest.mark.parametrize("argv,message", FLAG_ERRORS, ids=[" ".join(a) for a, _ in FLAG_ERRORS])
def test_flag_errors_before_any_rank(argv, message, capsys, monkeypatch):
    forbid_ranks(monkeypatch)
    assert message in _refused(argv, capsys)


#: the edge of each range, and the words: accepted (no check is stricter than its range)
ACCEPTED = [
    ["--warmup", "0"],
    ["--save-every", "0"],
    ["--keep-last", "0"],
    ["--log-every", "1"],
    ["--max-skipped-steps", "1"],
    ["--min-lr", "0"],
    ["--weight-decay", "0"],
    ["--seed", "-5"],
    ["--lr-schedule", "constant", "--lr", "1e-4"],
    ["--lr-schedule", "cosine"],
    ["--top-k", "4"],
    ["--moe-every", "0", "--ep", "1"],
    ["--lr", "3e-4"],
    ["--collective-timeout", "0.5"],
    ["--capacity-factor", "0.5"],
    ["--seq-len", "1"],
    ["--loss-scale", "1"],
    ["--loss-scale", str(2**40)],
    ["--lr", "1e-4"],  # the cosine floor follows --lr (lr / 10) unless --min-lr is given
]


@pytest.mark.parametrize("argv", ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_values_at_the_edge_are_accepted(argv):
    config_from(build_parser().parse_args(argv)).check()


def test_checkpoint_dir_flags_pass_with_a_directory(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    argv = [
        "--checkpoint-dir",
        ckpt,
        "--save-every",
        "2",
        "--keep-last",
        "1",
        "--resume",
        "--allow-fresh",
        "--allow-other-run",
        "--allow-schedule-change",
    ]
    config_from(build_parser().parse_args(argv)).check()
    forbid_ranks(monkeypatch)
    (tmp_path / "file").write_text("x")
    for name in ("--checkpoint-dir", "--profile"):
        err = _refused([name, str(tmp_path / "file")], capsys)
        assert f"{name} {tmp_path / 'file'} is a file, not a directory: pass a directory" in err
    assert "--keep-last -1 must be >= 0" in _refused(
        ["--checkpoint-dir", ckpt, "--keep-last", "-1"], capsys
    )


def test_a_bad_collective_timeout_variable_is_named(monkeypatch):
    from fastpar.train.config import _seconds

    monkeypatch.setenv("FASTPAR_COLLECTIVE_TIMEOUT", "soon")
    cfg = TrainConfig.from_flags(collective_timeout=_seconds("soon"))
    with pytest.raises(ValueError, match=r"FASTPAR_COLLECTIVE_TIMEOUT='soon' is not a positive"):
        cfg.check()
    monkeypatch.setenv("FASTPAR_COLLECTIVE_TIMEOUT", "-3")
    with pytest.raises(ValueError, match=r"FASTPAR_COLLECTIVE_TIMEOUT='-3' is not a positive"):
        TrainConfig.from_flags(collective_timeout=_seconds("-3")).check()


# -- memory ------------------------------------------------------------------------------------
def test_activation_estimate_by_hand():
    # one fp32 GPT rank, 1 layer, hidden 64, 4 heads, ffn 256, vocab 256, 1 row x 1000 tokens;
    # bytes a token: the embedding keeps the int64 id (8); each of the block's two RMSNorms its
    # input, 1 / rms and normalised output (4·64 + 4 + 4·64 = 516) and the linear after it its
    # input (4·64); the attention its q|k|v buffer and output (4·4·64) and a log-sum-exp a
    # head (4·4); the MLP its fc and GELU outputs (2·4·256): 4632 in all; the head its norm
    # (516) and the norm's output (4·64), the fp32 logits (4·256), the int64 target and two
    # fp32 statistics (16): 1812
    cfg = TrainConfig.from_flags(**ONE_RANK, layers=1, batch_size=1, microbatches=1, seq_len=1000)
    one = (8 + 4632 + 1812) * 1000
    assert memory.activation_bytes(cfg) == (one, one)
    # two data-parallel replicas hold two copies on the machine, one each
    rank, world = memory.activation_bytes(
        TrainConfig.from_flags(**{**cfg.flags(), "dp": 2, "batch_size": 2})
    )
    assert (rank, world) == (one, 2 * one)


@pytest.mark.parametrize(
    "layout",
    [
        {},
        dict(moe_every=1),
        dict(tp=2),
        dict(pp=2, microbatches=2, batch_size=8),
        dict(pp=2, microbatches=2, batch_size=8, schedule="gpipe", recompute=True),
        dict(model_type="llama", precision="bf16"),
        dict(model_type="deepseek", moe_every=1),
        dict(model_type="deepseek", moe_every=0, q_lora_rank=0, v_head_dim=24),
    ],
    ids=[
        "gpt",
        "moe",
        "tp2",
        "pp2-1f1b",
        "pp2-gpipe-recompute",
        "llama-bf16",
        "deepseek-moe",
        "deepseek-noq-equal-heads",
    ],
)
@pytest.mark.own_ranks  # ru_maxrss: the peak of fresh processes, not of the pool's live ranks
def test_activation_estimate_is_below_the_measured_memory(layout):
    """The estimate is a lower bound of what the ranks' peak memory grows by with seq_len
    (measured: ru_maxrss of the busiest rank), and not a vacuous one (at least a third)."""
    base = dict(
        ONE_RANK, steps=1, batch_size=4, microbatches=1, layers=2, hidden=64, heads=4, quiet=True
    )
    measured, estimated = [], []
    for seq_len in (128, 3072):
        cfg = TrainConfig.from_flags(**{**base, **layout, "seq_len": seq_len})
        measured.append(launch(cfg)[-1]["max_mem_mib"] * 2**20)
        estimated.append(memory.activation_bytes(cfg)[0])
    grew, est = measured[1] - measured[0], estimated[1] - estimated[0]
    # ru_maxrss of a forked rank starts from its parent's resident pages, which shift between
    # the two launches by a few MiB (96.3 MiB grown against 97.8 estimated once, on a loaded
    # machine): the lower bound allows 10 %
    assert 0.9 * est <= grew <= 3 * est, (grew / 2**20, est / 2**20)


def _machine(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(memory, "_ram_available", lambda: int(gib * 2**30))


def test_a_sequence_that_cannot_fit_is_refused_with_the_estimate(capsys, monkeypatch):
    forbid_ranks(monkeypatch)
    _machine(monkeypatch, 16)
    err = _refused(["--seq-len", "100000"], capsys)
    needed = float(re.search(r"need at least ([\d.]+) GiB on the 8 ranks on this machine", err)[1])
    assert needed > 16 and "against 16.0 GiB of RAM available" in err
    assert "use a shorter --seq-len, a smaller --batch-size, more --microbatches" in err
    # the estimate grows with the sequence: a tenth of it fits, and is not refused
    cfg = config_from(build_parser().parse_args(["--seq-len", "10000"]))
    assert memory.activation_bytes(cfg)[1] < needed * 2**30 / 5
    cfg.check()


def test_a_tight_fit_warns_and_runs(capsys, monkeypatch):
    cfg = config_from(build_parser().parse_args(argv(**ONE_RANK, seq_len=4096)))
    needed = memory.activation_bytes(cfg)[1]
    _machine(monkeypatch, needed / 0.7 / 2**30)  # 70 % of the memory
    launched = []
    monkeypatch.setattr(cli, "launch", lambda cfg, tokens: launched.append(cfg) or [])
    assert main(argv(**ONE_RANK, seq_len=4096)) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning: the activations kept for backward") and err.endswith("(70%)")
    assert len(launched) == 1


def test_a_gpu_compares_one_rank_with_its_memory(monkeypatch):
    import torch

    class Props:
        total_memory = 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")
    cfg = TrainConfig.from_flags(seq_len=40000)
    est = memory.estimate(cfg)
    assert (est.needed, est.available, est.ranks) == (memory.activation_bytes(cfg)[0], 2**30, 1)
    with pytest.raises(
        ValueError, match=r"on one rank, against 1.0 GiB of GPU memory \(Fake GPU\)"
    ):
        cfg.check()


# -- torchrun ----------------------------------------------------------------------------------
def _torchrun(monkeypatch, world: int, local_rank: int = 0) -> None:
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))


@pytest.mark.parametrize(
    "world,argv,dp",
    [
        (None, [], 2),
        (None, ["--tp", "1", "--pp", "1"], 2),
        (2, ["--tp", "2", "--pp", "1"], 1),
        (8, ["--tp", "2", "--pp", "2"], 2),
        (16, [], 4),
        (8, ["--dp", "3"], 3),
    ],
)
def test_dp_follows_the_torchrun_world(world, argv, dp, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if world is not None:
        _torchrun(monkeypatch, world)
    cfg = config_from(build_parser().parse_args(argv))
    assert cfg.dp == dp and isinstance(cfg.dp, int)


WORLD_ERRORS = [
    (
        2,
        ["--tp", "2", "--pp", "1", "--dp", "2"],
        "torchrun started 2 ranks but tp*pp*dp = 2*1*2 = 4: pass --dp 1 --ep 1",
        True,
    ),
    (
        2,
        ["--tp", "2", "--pp", "1"],
        "torchrun started 2 ranks: dp = 1, which ep 2 does not divide: pass --dp 1 --ep 1",
        False,
    ),
    (
        2,
        [],
        "torchrun started 2 ranks, not a multiple of tp*pp = 2*2 = 4: pass --pp 1 --dp 1 --ep 1",
        True,
    ),
    (4, ["--tp", "3", "--pp", "1"], "not a multiple of tp*pp = 3*1 = 3: pass --tp 2 --dp 2", False),
    (
        6,
        ["--batch-size", "12", "--microbatches", "1"],
        "torchrun started 6 ranks, not a multiple of tp*pp = 2*2 = 4: pass --pp 1 --dp 3 --ep 1",
        True,
    ),
    (
        6,
        [],
        "torchrun started 6 ranks, not a multiple of tp*pp = 2*2 = 4: pass --pp 3 --dp 1 --ep 1",
        True,
    ),  # pp 1 would make dp 3, which does not split the batch of 16
]


@pytest.mark.parametrize("world,argv,message,as_given", WORLD_ERRORS)
def test_a_torchrun_world_mismatch_is_one_line_with_a_hint_that_runs(
    world, argv, message, as_given, capsys, monkeypatch
):
    forbid_ranks(monkeypatch)
    slept = []  # a silent local rank waits before it exits (cli.SILENT_RANK_WAIT_S): not here
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    _torchrun(monkeypatch, world)
    err = _refused(argv, capsys)
    assert message in err
    assert ("or start" in err) == as_given  # the layout as given, where it works elsewhere
    hint = re.search(r": pass ((?:--\w+ \d+ ?)+)", err)[1].split()
    launched = []
    monkeypatch.setattr(cli, "launch", lambda cfg, tokens: launched.append(cfg) or [])
    assert main([*argv, *hint]) == 0, capsys.readouterr().err  # the hint is a run that starts
    assert launched[0].world_size == world
    _torchrun(monkeypatch, world, local_rank=1)  # the other local ranks stay silent
    assert main(argv) == 2 and capsys.readouterr().err == ""
    assert slept == [cli.SILENT_RANK_WAIT_S]  # it waited, silent


def test_launch_under_torchrun_checks_the_world_before_the_process_group(monkeypatch):
    import fastpar.mesh

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was created")

    monkeypatch.setattr(fastpar.mesh, "init", no_group)
    _torchrun(monkeypatch, 2)
    cfg = TrainConfig.from_flags(tp=2, pp=1, dp=2, ep=1, moe_every=0, steps=1)
    with pytest.raises(ValueError, match=r"^torchrun started 2 ranks but tp\*pp\*dp = 2\*1\*2 = 4"):
        launch(cfg)


def test_a_silent_rank_outlives_the_rank_that_prints_a_refusal(monkeypatch, capsys):
    """torchrun ends every worker when one exits: local rank 1 (silent) waits, so local rank 0
    has printed the refusal before anything kills it (under load, rank 1 once exited first and
    the run ended without a word)."""
    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.refuse(ValueError("bad flag")) == 2
    assert slept == [cli.SILENT_RANK_WAIT_S] and cli.SILENT_RANK_WAIT_S >= 10
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cli.refuse(ValueError("bad flag")) == 2
    assert slept == [cli.SILENT_RANK_WAIT_S]  # rank 0 does not wait
    assert capsys.readouterr().err == "error: bad flag\n"


@pytest.mark.slow  # two torchrun jobs
def test_torchrun_without_dp_and_with_a_wrong_one():
    run = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fastpar.train",
        *tiny_argv(tp=2, pp=1, ep=1, moe_every=0, quiet=False),  # --dp: the world's
    ]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world 2 = dp 1 x tp 2 x pp 1 (ep 1)" in out.stdout
    assert "step    2/2" in out.stdout
    bad = subprocess.run([*run, "--dp", "2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    ours = [line for line in bad.stderr.splitlines() if "fastpar" in line or "error:" in line]
    errors = [line for line in ours if line.startswith("error: ")]
    assert errors == [
        "error: torchrun started 2 ranks but tp*pp*dp = 2*1*2 = 4: pass --dp 1 "
        "(--dp may be left out: it follows the world size), or start 4 ranks"
    ]
    assert not any("File " in line and "/fastpar/" in line for line in ours)  # no traceback
