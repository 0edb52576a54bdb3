"""``python -m fastpar.checkpoint info|verify|export``: on a fastpar.train run's directory of
checkpoints and on a TP=2 library checkpoint whose full tensors the ranks gather themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _flags import ONE_RANK, tiny_config
from _mesh import make_mesh
from torch import nn

from fastpar import checkpoint
from fastpar.checkpoint.cli import main
from fastpar.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig, launch

V, H = 11, 8  # 11 vocabulary rows over TP=2: one padding row


class _Net(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.emb = VocabParallelEmbedding(V, H, mesh=mesh)
        self.qkv = ColumnParallelLinear(H, 3 * H, fused=3, mesh=mesh)
        self.proj = RowParallelLinear(H, H, mesh=mesh)
        self.norm = nn.LayerNorm(H)


def _gathered(local: torch.Tensor, dim: int, group, fused: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's shard along ``dim`` (``fused`` blocks each)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    blocks = [p.chunk(fused, dim) for p in parts]
    return torch.cat([b[i] for i in range(fused) for b in blocks], dim)


def _save_tp2(path: str) -> dict[str, torch.Tensor]:
    mesh = make_mesh(tp=2)
    torch.manual_seed(0)
    model = _Net(mesh)
    with torch.no_grad():
        for p in model.parameters():  # distinct values on every rank's shard
            p.add_(torch.randn_like(p) * (1 + dist.get_rank()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    checkpoint.save(
        path, model_params=dict(model.named_parameters()), optimizer=opt, mesh=mesh, step=3
    )
    g = mesh.tp_group
    d = {n: p.detach() for n, p in model.named_parameters()}
    return {
        "emb.weight": _gathered(d["emb.weight"], 0, g)[:V],  # padding row dropped
        "qkv.weight": _gathered(d["qkv.weight"], 0, g, fused=3),
        "qkv.bias": _gathered(d["qkv.bias"], 0, g, fused=3),
        "proj.weight": _gathered(d["proj.weight"], 1, g),
        "proj.bias": d["proj.bias"].clone(),
        "norm.weight": d["norm.weight"].clone(),
        "norm.bias": d["norm.bias"].clone(),
    }


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lib") / "ckpt")
    return path, run_ranks(_save_tp2, 2, path)[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A fastpar.train run at TP=2 saving steps 1 and 2."""
    root = tmp_path_factory.mktemp("run")
    cfg = TrainConfig.from_flags(
        **tiny_config(ONE_RANK, batch_size=4, layers=1, tp=2, model_type="llama", kv_heads=2),
        checkpoint_dir=str(root / "ckpt"),
        save_every=1,
    )
    launch(cfg)
    return str(root / "ckpt")


def test_info_of_a_run_directory_picks_the_newest_and_shows_the_config(run_dir, capsys):
    assert main(["info", run_dir, "--json"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert "using step_000002, the newest complete of 2 checkpoints" in err
    assert d["step"] == 2 and d["world_size"] == 2 and d["layout"]["mesh"]["tp"] == 2
    assert d["run_id"] and d["config"]["hidden"] == 32 and d["config"]["tp"] == 2
    files = sorted(os.listdir(os.path.join(run_dir, "step_000002")))
    sizes = {f: os.path.getsize(os.path.join(run_dir, "step_000002", f)) for f in files}
    assert d["total_bytes"] == sum(v for f, v in sizes.items() if f.endswith(".pt"))
    shapes = {t["name"]: t["shape"] for t in d["tensors"]}
    assert any(s == [32] for s in shapes.values())  # norms: hidden
    assert main(["info", os.path.join(run_dir, "step_000001")]) == 0
    out, err = capsys.readouterr()
    assert "step 1 " in out and "world 2, tp=2" in out and "config: " in out and err == ""


def test_info_and_verify_of_a_library_checkpoint(tp2, capsys):
    path = tp2[0]
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    assert "emb.weight" in out and "11x8" in out and "float32" in out and "352 B" in out
    assert "config: none stored" in out
    assert main(["verify", path]) == 0
    assert "every sha256 matches" in capsys.readouterr().out


def test_export_pt_and_safetensors_equal_the_gathered_tensors(tp2, tmp_path):
    from safetensors.torch import load_file

    path, full = tp2
    assert main(["export", path, str(tmp_path / "m.pt")]) == 0
    assert main(["export", path, str(tmp_path / "m.st"), "--format", "safetensors"]) == 0
    for state in (torch.load(tmp_path / "m.pt", weights_only=True), load_file(tmp_path / "m.st")):
        assert set(state) == set(full)
        for name, t in full.items():
            assert torch.equal(state[name], t), name


@pytest.mark.slow  # a subprocess export; scripts/run_main.sh runs fastpar.export --check too
def test_export_hf_runs_fastpar_export(run_dir, tmp_path):
    """The real command, in its own process (``--hf`` starts ``python -m fastpar.export``)."""
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "fastpar.checkpoint", "export", run_dir, str(out), "--hf"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    assert any(f.endswith(".safetensors") for f in os.listdir(out))


def _flip(path: str, at: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_verify_fails_on_one_flipped_byte(tp2, tmp_path, capsys):
    import shutil

    path = str(tmp_path / "copy")
    shutil.copytree(tp2[0], path)
    _flip(os.path.join(path, "rank00001.pt"))
    assert main(["verify", path]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "CORRUPTED" in err and "sha256 mismatch for rank00001.pt" in err
    assert main(["export", path, str(tmp_path / "m.pt")]) == 1  # export reads it, and refuses
    assert "sha256 mismatch" in capsys.readouterr().err


def test_bad_input_names_the_value_and_the_fix(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["info", missing]) == 2
    assert f"{missing} does not exist: give a checkpoint directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "is not a fastpar checkpoint" in capsys.readouterr().err
    (tmp_path / "runs" / "step_000004").mkdir(parents=True)  # a save that never finished
    assert main(["info", str(tmp_path / "runs")]) == 2
    assert "holds no complete checkpoint: step_000004 (incomplete" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export"])  # argparse: the missing arguments


def test_help_describes_every_command(capsys):
    for argv in (["--help"], ["export", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "verify" in text or "--format" in text
    assert "safetensors" in text and "Hugging Face" in text
