"""``fastpar.checkpoint.load_hf``, the sliced import: each TP rank reads only its slices of a
genuine Hugging Face checkpoint (transformers' own save_pretrained, several files), every loaded
tensor its slice bit for bit and the logits at TP 4 by ``fastpar.tolerance``'s rule; experts,
fused q|k|v blocks and padding rows; a single-process plain model in another dtype; the errors;
a missing package naming the extra. Expected values: as tests/test_checkpoint_hf.py says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from _parity import local_slice
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from _checkpoint_hf import EXACT, dense_model, logits_agree, model_config, tp_model  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from fastpar.checkpoint import (  # noqa: E402
    CheckpointError,
    export_hf,
    load_hf,
)
from fastpar.nn.marks import mark_expert, mark_sharded, param_layout  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402


class _Reads:
    """Wraps ``safetensors.safe_open`` to record every tensor read: (key, shape, bytes)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, tuple, int]] = []
        self.real = safetensors.safe_open

    def __call__(self, path, framework, **kwargs):
        return _File(self.real(path, framework, **kwargs), self.log)

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.log)


class _File:
    def __init__(self, f, log) -> None:
        self.f, self.log = f, log

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, key):
        t = self.f.get_tensor(key)
        self.log.append((key, tuple(t.shape), t.numel() * t.element_size()))
        return t

    def get_slice(self, key):
        return _Slice(self.f.get_slice(key), key, self.log)


class _Slice:
    def __init__(self, sl, key, log) -> None:
        self.sl, self.key, self.log = sl, key, log

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, index):
        t = self.sl[index]
        self.log.append((self.key, tuple(t.shape), t.numel() * t.element_size()))
        return t


def _expected_local(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    layout = param_layout(p)
    return full if layout is None else local_slice(full, p, layout.fused)


def _load_tp4(kind: str, directory: str):
    reads = _Reads()
    safetensors.safe_open = reads  # this rank's process only
    dense = dense_model(kind)
    full = dense.state_dict()
    par = tp_model(dense_model(kind, seed=1))  # other values: all must come from the file
    stats = load_hf(par, directory)
    own, sharded = 0, {}
    for name, p in par.named_parameters():
        expected = _expected_local(p, full[name])
        torch.testing.assert_close(p.detach(), expected, **EXACT, msg=name)
        valid = _expected_local(p, torch.ones(full[name].shape)).sum()
        own += int(valid) * 4  # fp32 file: 4 bytes an element, padding rows not in the file
        if param_layout(p) is not None and param_layout(p).kind == "sharded":
            sharded[name] = full[name].numel()
    too_big = [k for k, shape, _ in reads.log if k in sharded and _numel(shape) >= sharded[k]]
    logits_agree(par, dense, f"{kind} logits at TP 4 on rank {dist.get_rank()}")
    c_attn = sorted(s for k, s, _ in reads.log if k == "transformer.h.0.attn.c_attn.weight")
    return reads.bytes, stats.bytes_read, own, too_big, len(stats.files), c_attn


def _numel(shape: tuple) -> int:
    return torch.Size(shape).numel()


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2", "gpt2", "bert"])
def test_load_hf_at_tp4_reads_only_this_ranks_slices(kind, tmp_path):
    # a genuine HF checkpoint: transformers' own save_pretrained, several files + index.json
    # (for the tied model it omits lm_head.weight)
    dense_model(kind).save_pretrained(tmp_path, max_shard_size="30KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        nfiles = len(set(json.load(f)["weight_map"].values()))
    assert nfiles > 1
    for counted, reported, own, too_big, opened, c_attn in run_ranks(
        _load_tp4, 4, kind, str(tmp_path)
    ):
        assert counted == reported
        assert counted <= 1.1 * own, (counted, own)
        assert too_big == []  # no read covered the whole tensor of a sharded parameter
        assert opened == nfiles
        if kind == "gpt2":  # [in, 3 * out] split along dim 1: one range per block of q | k | v
            assert c_attn == [(32, 8)] * 3


def _small_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {"experts": (4, 3, 5), "qkv": (12, 5), "padded": (7, 5), "norm": (5,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _experts_and_fused(path: str):
    """EP over the 2 ranks (4 experts), a fused q|k|v weight and a padded column weight."""
    rank = dist.get_rank()
    reads = _Reads()
    safetensors.safe_open = reads
    full = _small_full()
    params = {
        "experts": nn.Parameter(torch.full((2, 3, 5), 9.0)),
        "qkv": nn.Parameter(torch.full((6, 5), 9.0)),
        "padded": nn.Parameter(torch.full((4, 5), 9.0)),
        "norm": nn.Parameter(torch.full((5,), 9.0)),
    }
    mark_expert(params["experts"], dist.group.WORLD, num_experts=4)
    mark_sharded(params["qkv"], 0, None, 12, fused=3)
    mark_sharded(params["padded"], 0, None, 7)
    stats = load_hf(params, path)
    # bit for bit: loading copies this rank's slices
    expect = {
        "experts": full["experts"][2 * rank : 2 * rank + 2],
        "qkv": local_slice(full["qkv"], params["qkv"], 3),
        "padded": local_slice(full["padded"], params["padded"]),
        "norm": full["norm"],
    }
    for name, t in expect.items():
        torch.testing.assert_close(params[name].detach(), t, **EXACT, msg=name)
    shapes = {k: sorted(s for key, s, _ in reads.log if key == k) for k in full}
    return shapes, stats.bytes_read


def test_load_hf_experts_fused_blocks_and_padding(tmp_path):
    full = _small_full()
    save_file(full, tmp_path / "model.safetensors")
    (r0, b0), (r1, b1) = run_ranks(_experts_and_fused, 2, str(tmp_path))
    for shapes in (r0, r1):
        assert shapes["experts"] == [(2, 3, 5)]
        assert shapes["qkv"] == [(2, 5)] * 3  # one range per block of q | k | v
        assert shapes["norm"] == [(5,)]
    assert r0["padded"] == [(4, 5)] and r1["padded"] == [(3, 5)]  # the padding row not read
    assert b0 == 4 * (30 + 30 + 20 + 5) and b1 == 4 * (30 + 30 + 15 + 5)


def test_load_hf_single_process_plain_model_converts_dtype(tmp_path):
    assert not dist.is_initialized()
    kind = "llama-tied"
    cfg = model_config(kind)
    dense = dense_model(kind).to(torch.bfloat16)
    dense.save_pretrained(tmp_path)  # one model.safetensors, bf16, no lm_head.weight
    model = transformers.LlamaForCausalLM(cfg)  # fp32
    with pytest.warns(
        UserWarning, match=r"converted \d+ tensors \(torch.bfloat16 -> torch.float32"
    ):
        stats = load_hf(model, tmp_path)
    distinct = {id(p): p for p in dense.parameters()}.values()
    assert stats.bytes_read == sum(p.numel() * 2 for p in distinct)
    assert stats.converted["model.norm.weight"] == "torch.bfloat16 -> torch.float32"
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, dense.state_dict()[name].float(), **EXACT, msg=name)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_hf_errors(tmp_path):
    full = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(5)}
    params = {"a.weight": nn.Parameter(torch.zeros(4, 3)), "b.weight": nn.Parameter(torch.zeros(5))}
    os.makedirs(tmp_path / "missing")
    save_file({"a.weight": full["a.weight"]}, tmp_path / "missing" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"1 model tensors are absent from it: 'b.weight'"):
        load_hf(params, tmp_path / "missing")
    stats = load_hf(params, tmp_path / "missing", strict=False)
    assert stats.missing == ["b.weight"] and stats.loaded == ["a.weight"]
    torch.testing.assert_close(params["a.weight"].detach(), full["a.weight"], **EXACT)  # a copy
    assert bool((params["b.weight"] == 0).all())

    os.makedirs(tmp_path / "extra")
    save_file({**full, "c.bias": torch.ones(2)}, tmp_path / "extra" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"1 keys no model tensor claims: 'c.bias'"):
        load_hf(params, tmp_path / "extra")
    assert load_hf(params, tmp_path / "extra", strict=False).unexpected == ["c.bias"]

    os.makedirs(tmp_path / "shape")
    save_file({**full, "b.weight": torch.randn(6)}, tmp_path / "shape" / "model.safetensors")
    fresh = {n: nn.Parameter(torch.zeros_like(t)) for n, t in full.items()}
    with pytest.raises(CheckpointError, match=r"'b.weight': the checkpoint holds \[6\], .* \[5\]"):
        load_hf(fresh, tmp_path / "shape")
    assert all(bool((p == 0).all()) for p in fresh.values())  # nothing loaded before the check

    os.makedirs(tmp_path / "empty")
    with pytest.raises(
        CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index"
    ):
        load_hf(params, tmp_path / "empty")
    with open(tmp_path / "empty" / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}, f)
    with pytest.raises(
        CheckpointError, match=r"model-00001-of-00002\.safetensors, which is missing"
    ):
        load_hf(params, tmp_path / "empty")


def test_missing_packages_name_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install fastpar\[hf\]"):
        export_hf({}, tmp_path, {"model_type": "llama"})
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"pip install fastpar\[hf\]"):
        load_hf({}, tmp_path)
    code = """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("transformers", "safetensors"):
                    raise ImportError("blocked for this test")
        sys.meta_path.insert(0, Block())
        import fastpar, fastpar.checkpoint
        from fastpar.checkpoint import export_hf, load_hf, save_hf, guard_save_pretrained
        print("ok")
        """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]
