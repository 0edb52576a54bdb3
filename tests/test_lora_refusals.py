"""LoRA's refusals at the layer level (issue 48, point 7): each a one-line ValueError that names
the module (or target) and the fix, raised before the model changes.

* ``apply_lora``: a target that matches no module, ``experts``, a rank above min(in, out) or
  not a positive integer, a module with no exact adapter layout (an embedding, a Conv1D, the
  shared-key linear of parallelize's MQA plan), a module that already has one, a dropout
  outside [0, 1);
* ``load_peft``: an adapter made for a base of another shape, a module the model lacks,
  PEFT options fastpar does not compute (DoRA, rsLoRA), a directory without PEFT's files.

The rank is never split (column: B [out/tp, r]; row: A [r, in/tp]), so no rank is refused for
a tensor-parallel size: rank 3 at TP 2 builds and computes (tests/test_nn_lora.py proves the
layouts' math).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _hf import build
from torch import nn

from fastpar.checkpoint.lora import load_peft, save_peft
from fastpar.nn import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.lora import LoRALinear, apply_lora
from fastpar.nn.shared_key import SharedKeyLinear
from fastpar.testing import run_ranks


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> None:
    text = str(exc.value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, (w, text)


def _llama():
    return build("llama")


def _untouched(model: nn.Module) -> None:
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_target_matching_no_module():
    model = _llama()
    with pytest.raises(ValueError) as e:
        apply_lora(model, "q,qkv", 4, 8)
    _one_line(e, "'qkv'", "matches no module", "q_proj", "name one of those")
    _untouched(model)


def test_experts_are_refused():
    with pytest.raises(ValueError) as e:
        apply_lora(_llama(), "q,experts", 4, 8)
    _one_line(e, "'experts'", "not supported yet", "leave experts out")


@pytest.mark.parametrize("rank", [33, 0, -1, 2.0])
def test_rank_out_of_range(rank):
    model = _llama()  # hidden 32: q_proj is 32 -> 64, k_proj 32 -> 32
    with pytest.raises(ValueError) as e:
        apply_lora(model, "q,k", rank, 8)
    if rank == 33:
        _one_line(e, "'model.layers.0.self_attn.q_proj'", "rank 33", "min(in_features 32")
        _one_line(e, "use a rank of at most that")
    else:
        _one_line(e, "'model.layers.0.self_attn.q_proj'", "positive integer")
    _untouched(model)


def test_module_without_exact_layout():
    model = _llama()
    with pytest.raises(ValueError) as e:
        apply_lora(model, "embed_tokens", 4, 8)
    _one_line(e, "'model.embed_tokens'", "Embedding", "no exact adapter layout", "leave it out")
    shared = nn.Module()
    shared.k = SharedKeyLinear(8, 8, features=4)  # parallelize's MQA key: its own backward
    with pytest.raises(ValueError) as e:
        apply_lora(shared, "k", 2, 4)
    _one_line(e, "'k'", "SharedKeyLinear", "leave it out")
    conv = nn.Module()
    conv.proj = nn.Conv1d(4, 4, 1)  # a torch convolution, not Hugging Face's Conv1D
    with pytest.raises(ValueError) as e:
        apply_lora(conv, "proj", 2, 4)
    _one_line(e, "'proj'", "Conv1d", "leave it out")


def test_twice_and_dropout():
    model = _llama()
    apply_lora(model, "q", 4, 8)
    with pytest.raises(ValueError) as e:
        apply_lora(model, "q_proj", 4, 8)
    _one_line(e, "q_proj'", "already has an adapter", "apply_lora once")
    model = _llama()
    with pytest.raises(ValueError) as e:
        apply_lora(model, "v", 4, 8, dropout=1.0)
    _one_line(e, "v_proj'", "dropout 1.0", "[0, 1)")
    _untouched(model)


def _saved(tmp_path, **overrides) -> str:
    model = build("llama", **overrides)
    apply_lora(model, "q,down", 4, 8)
    save_peft(model, tmp_path)
    return str(tmp_path)


def test_load_adapter_for_another_base_shape(tmp_path):
    directory = _saved(tmp_path, intermediate_size=48)  # down_proj: 48 -> 32, not 40 -> 32
    model = _llama()
    with pytest.raises(ValueError) as e:
        load_peft(model, directory)
    _one_line(e, "'model.layers.0.mlp.down_proj'", "lora_A has shape [4, 48]", "[4, 40]")
    _one_line(e, "a base of another shape", "load one made for this model")
    _untouched(model)


def test_load_onto_an_adapter_of_another_rank(tmp_path):
    directory = _saved(tmp_path)  # rank 4, alpha 8
    model = _llama()
    apply_lora(model, "q", 2, 8)
    with pytest.raises(ValueError) as e:
        load_peft(model, directory)
    _one_line(e, "'model.layers.0.self_attn.q_proj'", "rank 2, alpha 8", "rank 4, alpha 8")
    _one_line(e, "load onto a model without adapters there")


def test_load_unknown_module(tmp_path):
    directory = _saved(tmp_path, num_hidden_layers=3)
    model = _llama()  # two layers
    with pytest.raises(ValueError) as e:
        load_peft(model, directory)
    _one_line(e, "'model.layers.2.", "which the model lacks", "the base model it was made for")
    _untouched(model)


def test_load_refuses_what_it_does_not_compute(tmp_path):
    directory = _saved(tmp_path)
    path = os.path.join(directory, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    for key, what in (("use_dora", "DoRA"), ("use_rslora", "rsLoRA")):
        with open(path, "w") as f:
            json.dump({**config, key: True}, f)
        with pytest.raises(ValueError) as e:
            load_peft(_llama(), directory)
        _one_line(e, what, "not supported")
    with pytest.raises(ValueError) as e:
        load_peft(_llama(), os.path.join(directory, "missing"))
    _one_line(e, "adapter_config.json", "save_pretrained")


def test_save_without_adapters(tmp_path):
    with pytest.raises(ValueError) as e:
        save_peft(_llama(), tmp_path)
    _one_line(e, "no LoRA adapters", "apply_lora first")


def _odd_rank_at_tp2() -> list:
    torch.manual_seed(0)
    col = LoRALinear(ColumnParallelLinear(8, 6), 3, 6.0)
    row = LoRALinear(RowParallelLinear(6, 8), 3, 6.0)
    return [tuple(col.lora_A.shape), tuple(col.lora_B.shape), tuple(row.lora_A.shape)]


def test_rank_is_never_split():
    shapes = run_ranks(_odd_rank_at_tp2, 2)
    assert shapes == [[(3, 8), (3, 3), (3, 3)]] * 2


def test_fastpar_never_imports_peft(tmp_path):
    """PEFT is a test client only: importing fastpar, its LoRA and writing PEFT's files leave
    peft unimported (its own process: this one may have imported peft)."""
    code = (
        "import sys, torch, fastpar\n"
        "from fastpar.nn.lora import apply_lora\n"
        "from fastpar.checkpoint.lora import save_peft\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "apply_lora(m, '0', 2, 4)\n"
        f"save_peft(m, {str(tmp_path)!r})\n"
        "print('peft' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]
