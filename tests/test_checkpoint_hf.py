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

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from _checkpoint_hf import (  # noqa: E402
    EXACT,
    PLAN,
    dense_model,
    file_tensors,
    from_pretrained,
    model_config,
    same_logits,
    tp_model,
)
from _mesh import make_mesh  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

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
from fastpar.testing import run_ranks  # noqa: E402


# -- export ---------------------------------------------------------------------------------
def _save_tp2(kind: str, path: str) -> None:
    mesh = make_mesh(tp=2)
    par = tp_model(dense_model(kind), mesh)
    save(path, model_params=dict(par.named_parameters()), mesh=mesh, step=1)


@pytest.mark.parametrize("kind", ["llama-tied", "llama-untied", "gpt2"])
def test_export_of_a_tp_checkpoint_loads_in_transformers(kind, tmp_path):
    cfg = model_config(kind)
    run_ranks(_save_tp2, 2, kind, str(tmp_path / "ckpt"))
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", cfg)
    dense = dense_model(kind)
    files = file_tensors(out)
    assert set(files) == set(dense.state_dict())  # tied aliases included
    if kind != "llama-untied":
        assert "lm_head.weight" not in dict(dense.named_parameters())
        embedding = dense.get_input_embeddings().weight
        torch.testing.assert_close(files["lm_head.weight"], embedding, **EXACT)
    loaded = from_pretrained(out)
    assert type(loaded) is type(dense)
    same_logits(loaded, dense)


def test_export_with_biases_sharded_files_dtype_and_stale_files(tmp_path):
    kind = "qwen2"
    cfg = model_config(kind)
    dense = dense_model(kind)
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
    loaded = from_pretrained(out)
    torch.testing.assert_close(
        loaded.model.layers[1].self_attn.k_proj.bias,
        dense.model.layers[1].self_attn.k_proj.bias,
        **EXACT,
    )
    same_logits(loaded, dense)

    # the same directory again, in bf16, as one file: the earlier shards and index are gone
    export_hf(dict(dense.named_parameters()), out, cfg.to_dict(), dtype=torch.bfloat16)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    loaded = from_pretrained(out)
    for name, t in loaded.state_dict().items():
        assert t.dtype == torch.bfloat16, name
        torch.testing.assert_close(t, reference[name].to(torch.bfloat16), **EXACT)


def test_export_bert_adds_the_tied_decoder_weight_and_bias(tmp_path):
    kind = "bert"
    cfg = model_config(kind)
    dense = dense_model(kind)
    source = dict(dense.named_parameters())
    tied = ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]
    assert not set(tied) & set(source)  # named_parameters() drops them
    out = export_hf(source, tmp_path / "hf", cfg)
    files = file_tensors(out)
    assert set(files) == set(dense.state_dict())
    torch.testing.assert_close(files[tied[1]], dense.cls.predictions.bias, **EXACT)
    loaded = from_pretrained(out, transformers.AutoModelForMaskedLM)
    assert type(loaded) is transformers.BertForMaskedLM
    same_logits(loaded, dense)


def test_export_rename_callable_and_dict(tmp_path):
    kind = "llama-untied"
    cfg = model_config(kind)
    dense = dense_model(kind)
    ours = {f"net.{n}": p for n, p in dense.named_parameters()}
    ours["net.rope_cache"] = torch.zeros(3)  # not a HF tensor: the callable drops it

    def to_hf(name: str) -> str | None:
        return None if name == "net.rope_cache" else name.removeprefix("net.")

    out = export_hf(ours, tmp_path / "a", cfg, rename=to_hf)
    same_logits(from_pretrained(out), dense)
    renamed = {"tok": dense.model.embed_tokens.weight, "head": dense.lm_head.weight}
    source = {
        n: p
        for n, p in dense.named_parameters()
        if n not in ("model.embed_tokens.weight", "lm_head.weight")
    }
    source.update(renamed)
    table = {"tok": "model.embed_tokens.weight", "head": "lm_head.weight"}
    out = export_hf(source, tmp_path / "b", cfg, rename=table)
    same_logits(from_pretrained(out), dense)
    with pytest.raises(CheckpointError, match=r"unexpected 1 keys: 'tok'.*rename="):
        export_hf(source, tmp_path / "c", cfg, rename={"head": "lm_head.weight"})


def test_export_errors(tmp_path):
    kind = "llama-tied"
    cfg = model_config(kind)
    good = dict(dense_model(kind).named_parameters())
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


# -- the save_pretrained guard and save_hf --------------------------------------------------
def _guarded(kind: str, out: str):
    par = parallelize(dense_model(kind), PLAN)
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
    whole = dense_model(kind)  # unsharded: the guard leaves save_pretrained alone
    assert not guard_save_pretrained(whole)
    whole.save_pretrained(tmp_path / "whole")
    assert os.path.exists(tmp_path / "whole" / "model.safetensors")


def _save_and_reload(kind: str, out: str):
    mesh = make_mesh(tp=2, dp=2)  # each shard has two holders
    par = parallelize(dense_model(kind), PLAN, mesh=mesh)
    save_hf(par, out, mesh=mesh, max_shard_size="30KB")
    dist.barrier()
    fresh = parallelize(dense_model(kind, seed=1), PLAN, mesh=mesh)
    load_hf(fresh, out)
    for (name, p), q in zip(par.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, **EXACT, msg=name)


def test_save_hf_round_trip(tmp_path):
    kind = "llama-tied"
    out = str(tmp_path / "hf")
    run_ranks(_save_and_reload, 4, kind, out)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    dense = dense_model(kind)
    assert set(file_tensors(out)) == set(dense.state_dict())
    loaded = from_pretrained(out)
    same_logits(loaded, dense)
