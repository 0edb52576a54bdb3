"""fastpar.checkpoint.hf: export that transformers loads with no missing key and the same
logits; sliced import (each TP rank reads only its slices); save_hf; the save_pretrained guard.

Expected values come from transformers itself (its model classes, from_pretrained,
save_pretrained) and from the dense tensors, never from the code under test.

Saving, exporting and loading copy tensors, and a model loaded back is the same transformers
model on the same weights (the same kernels in the same order): those are bit for bit
(``EXACT``). A tensor-parallel model's logits are not (its all-reduces add partial sums): they
are judged by ``fastpar.tolerance``'s rule against the dense model in float64, with the dense
model in fp32 and its twin (weights one ulp away) as the measure of rounding (transformers'
RMSNorm and RoPE compute in fp32 even for float64: that reference is then as exact as fp32, and
the rule tolerates what the fp32 runs' errors show)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import _hf
import pytest
import torch
import torch.distributed as dist
from _parity import agree, exact_copy, local_slice
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from _mesh import make_mesh  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from fastpar import parallelize  # noqa: E402
from fastpar.checkpoint import (  # noqa: E402
    CheckpointError,
    ShardedSaveError,
    export_hf,
    guard_save_pretrained,
    load_hf,
    save,
    save_hf,
)
from fastpar.nn.marks import mark_expert, mark_sharded, param_layout  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402
from fastpar.tolerance import nudge  # noqa: E402

PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.[qkv]_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
    "lm_head": ("column", {"gather_output": True, "pad_output": True}),
}
KINDS = {  # test model -> (tests/_hf.py family, config overrides)
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "qwen2": ("qwen2", {}),  # q / k / v projections with biases
    "gpt2": ("gpt2", {}),  # Conv1D layers, fused q|k|v, biases, a tied LM head
    "bert": ("bert", {"architectures": ["BertForMaskedLM"]}),  # tied decoder weight and bias
}
EXACT = dict(rtol=0, atol=0)  # copies, and the same model on the same weights


def _config(kind: str):
    family, overrides = KINDS[kind]
    return _hf.config(family, **overrides)


def _parallel(model: nn.Module, mesh=None) -> nn.Module:
    """TP over the default group (or ``mesh``): the explicit plan for Llama-like models, the
    built-in one (fastpar.nn.plans) for GPT-2 and BERT."""
    if model.config.model_type in ("llama", "qwen2"):
        return parallelize(model, PLAN, mesh=mesh)
    return parallelize(model, mesh=mesh)


def _dense(kind: str, seed: int = 0) -> nn.Module:
    """The test model drawn under ``seed``, every parameter (biases and norms too) moved off
    its init by a seeded perturbation."""
    family, overrides = KINDS[kind]
    model = _hf.build(family, seed, **overrides)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return model.eval()


def _ids(vocab: int = _hf.VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(5))


def _same_logits(model: nn.Module, dense: nn.Module) -> None:
    """Bit for bit: ``model`` is ``dense``'s class holding the same weights (loaded back)."""
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, dense(_ids()).logits, **EXACT)


def _logits_agree(model: nn.Module, dense: nn.Module, what: str) -> None:
    """``model``'s logits (a parallel layout of ``dense``) by the rule: against ``dense`` in
    float64, with ``dense`` in fp32 and its twin as the measure of rounding."""
    twin, exact = exact_copy(dense).float(), exact_copy(dense)
    nudge(twin, seed=1)
    ids = _ids()
    with torch.no_grad():
        runs = [m(ids).logits for m in (dense, twin, exact)]
        got = model(ids).logits
    length = max(ids.numel(), *(max(p.shape) for p in dense.parameters()))
    agree(got, runs[:2], runs[2], what, length=length)


def _from_pretrained(out: str, auto=None):
    auto = auto or transformers.AutoModelForCausalLM
    # eager attention, as the models of tests/_hf.py use: the logits must be equal to the bit
    model, info = auto.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return model.eval()


def _file_tensors(out: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, f)))
    return tensors


# -- export ---------------------------------------------------------------------------------
def _save_tp2(kind: str, path: str) -> None:
    mesh = make_mesh(tp=2)
    par = _parallel(_dense(kind), mesh)
    save(path, model_params=dict(par.named_parameters()), mesh=mesh, step=1)


@pytest.mark.parametrize("kind", ["llama-tied", "llama-untied", "gpt2"])
def test_export_of_a_tp_checkpoint_loads_in_transformers(kind, tmp_path):
    cfg = _config(kind)
    run_ranks(_save_tp2, 2, kind, str(tmp_path / "ckpt"))
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", cfg)
    dense = _dense(kind)
    files = _file_tensors(out)
    assert set(files) == set(dense.state_dict())  # tied aliases included
    if kind != "llama-untied":
        assert "lm_head.weight" not in dict(dense.named_parameters())
        embedding = dense.get_input_embeddings().weight
        torch.testing.assert_close(files["lm_head.weight"], embedding, **EXACT)
    loaded = _from_pretrained(out)
    assert type(loaded) is type(dense)
    _same_logits(loaded, dense)


def test_export_with_biases_sharded_files_dtype_and_stale_files(tmp_path):
    kind = "qwen2"
    cfg = _config(kind)
    dense = _dense(kind)
    limit = 40_000
    out = export_hf(dict(dense.named_parameters()), tmp_path / "hf", cfg, max_shard_size="40KB")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    reference = dense.state_dict()
    assert set(index["weight_map"]) == set(reference)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in reference.values())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(f for f in os.listdir(out) if f.endswith("tensors")) == files
    for f in files:
        held = load_file(os.path.join(out, f))
        assert len(held) == 1 or sum(t.numel() * 4 for t in held.values()) <= limit, f
    loaded = _from_pretrained(out)
    torch.testing.assert_close(
        loaded.model.layers[1].self_attn.k_proj.bias,
        dense.model.layers[1].self_attn.k_proj.bias,
        **EXACT,
    )
    _same_logits(loaded, dense)

    # the same directory again, in bf16, as one file: the earlier shards and index are gone
    export_hf(dict(dense.named_parameters()), out, cfg.to_dict(), dtype=torch.bfloat16)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    loaded = _from_pretrained(out)
    for name, t in loaded.state_dict().items():
        assert t.dtype == torch.bfloat16, name
        torch.testing.assert_close(t, reference[name].to(torch.bfloat16), **EXACT)


def test_export_bert_adds_the_tied_decoder_weight_and_bias(tmp_path):
    kind = "bert"
    cfg = _config(kind)
    dense = _dense(kind)
    source = dict(dense.named_parameters())
    tied = ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]
    assert not set(tied) & set(source)  # named_parameters() drops them
    out = export_hf(source, tmp_path / "hf", cfg)
    files = _file_tensors(out)
    assert set(files) == set(dense.state_dict())
    torch.testing.assert_close(files[tied[1]], dense.cls.predictions.bias, **EXACT)
    loaded = _from_pretrained(out, transformers.AutoModelForMaskedLM)
    assert type(loaded) is transformers.BertForMaskedLM
    _same_logits(loaded, dense)


def test_export_rename_callable_and_dict(tmp_path):
    kind = "llama-untied"
    cfg = _config(kind)
    dense = _dense(kind)
    ours = {f"net.{n}": p for n, p in dense.named_parameters()}
    ours["net.rope_cache"] = torch.zeros(3)  # not a HF tensor: the callable drops it

    def to_hf(name: str) -> str | None:
        return None if name == "net.rope_cache" else name.removeprefix("net.")

    out = export_hf(ours, tmp_path / "a", cfg, rename=to_hf)
    _same_logits(_from_pretrained(out), dense)
    renamed = {"tok": dense.model.embed_tokens.weight, "head": dense.lm_head.weight}
    source = {
        n: p
        for n, p in dense.named_parameters()
        if n not in ("model.embed_tokens.weight", "lm_head.weight")
    }
    source.update(renamed)
    table = {"tok": "model.embed_tokens.weight", "head": "lm_head.weight"}
    out = export_hf(source, tmp_path / "b", cfg, rename=table)
    _same_logits(_from_pretrained(out), dense)
    with pytest.raises(CheckpointError, match=r"unexpected 1 keys: 'tok'.*rename="):
        export_hf(source, tmp_path / "c", cfg, rename={"head": "lm_head.weight"})


def test_export_errors(tmp_path):
    kind = "llama-tied"
    cfg = _config(kind)
    good = dict(_dense(kind).named_parameters())
    bad = {**good, "model.norm.weight": torch.ones(31)}
    with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*\[31\].*\[32\]"):
        export_hf(bad, tmp_path / "a", cfg)
    missing = {n: t for n, t in good.items() if n != "model.norm.weight"}
    with pytest.raises(CheckpointError, match=r"missing 1 keys: 'model.norm.weight'"):
        export_hf(missing, tmp_path / "a", cfg)
    untied = {**good, "lm_head.weight": good["model.embed_tokens.weight"] + 1}
    with pytest.raises(CheckpointError, match=r"tied tensor.*tie_word_embeddings=False"):
        export_hf(untied, tmp_path / "a", cfg)
    with pytest.raises(ValueError, match="model_type=None"):
        export_hf(good, tmp_path / "a", {"hidden_size": 32})
    assert not os.path.exists(tmp_path / "a")  # every check runs before anything is written


# -- sliced import --------------------------------------------------------------------------
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
    dense = _dense(kind)
    full = dense.state_dict()
    par = _parallel(_dense(kind, seed=1))  # other values: all must come from the file
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
    _logits_agree(par, dense, f"{kind} logits at TP 4 on rank {dist.get_rank()}")
    c_attn = sorted(s for k, s, _ in reads.log if k == "transformer.h.0.attn.c_attn.weight")
    return reads.bytes, stats.bytes_read, own, too_big, len(stats.files), c_attn


def _numel(shape: tuple) -> int:
    return torch.Size(shape).numel()


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2", "gpt2", "bert"])
def test_load_hf_at_tp4_reads_only_this_ranks_slices(kind, tmp_path):
    # a genuine HF checkpoint: transformers' own save_pretrained, several files + index.json
    # (for the tied model it omits lm_head.weight)
    _dense(kind).save_pretrained(tmp_path, max_shard_size="30KB")
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
    cfg = _config(kind)
    dense = _dense(kind).to(torch.bfloat16)
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


# -- the save_pretrained guard and save_hf --------------------------------------------------
def _guarded(kind: str, out: str):
    par = parallelize(_dense(kind), PLAN)
    assert guard_save_pretrained(par)
    messages = []
    for call in (lambda: par.save_pretrained(out), lambda: par.push_to_hub("me/model")):
        with pytest.raises(ShardedSaveError) as info:
            call()
        messages.append(str(info.value))
    return messages


def test_guard_save_pretrained_refuses_a_sharded_model(tmp_path):
    kind = "llama-untied"
    out = str(tmp_path / "out")
    for messages in run_ranks(_guarded, 2, kind, out):
        for m in messages:
            assert "sharded by fastpar" in m and "rank's shards as if they were the whole" in m
            assert "fastpar.checkpoint.save_hf(model, out_dir, mesh=mesh)" in m
            assert "fastpar.checkpoint.export_hf(path, out_dir, model.config)" in m
    assert not os.path.exists(out)
    whole = _dense(kind)  # unsharded: the guard leaves save_pretrained alone
    assert not guard_save_pretrained(whole)
    whole.save_pretrained(tmp_path / "whole")
    assert os.path.exists(tmp_path / "whole" / "model.safetensors")


def _save_and_reload(kind: str, out: str):
    mesh = make_mesh(tp=2, dp=2)  # each shard has two holders
    par = parallelize(_dense(kind), PLAN, mesh=mesh)
    save_hf(par, out, mesh=mesh, max_shard_size="30KB")
    dist.barrier()
    fresh = parallelize(_dense(kind, seed=1), PLAN, mesh=mesh)
    load_hf(fresh, out)
    for (name, p), q in zip(par.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, **EXACT, msg=name)


def test_save_hf_round_trip(tmp_path):
    kind = "llama-tied"
    out = str(tmp_path / "hf")
    run_ranks(_save_and_reload, 4, kind, out)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    dense = _dense(kind)
    assert set(_file_tensors(out)) == set(dense.state_dict())
    loaded = _from_pretrained(out)
    _same_logits(loaded, dense)
