"""Small Hugging Face models (random init, built from configs: nothing is downloaded) for the
parallelize / verify tests, one per family with a built-in plan; a family's batches and loss,
and the dense runs (fp32, its twin, float64) a parallel run of it is judged against."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _parity import agree, local_part, same_on_every_rank

from fastpar.nn.marks import param_layout
from fastpar.parity import reduction_length
from fastpar.tolerance import cast, nudge

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install fastpar[hf])")

VOCAB = 101  # odd: the vocabulary shards need padding at TP 2 and 4

#: the size every small decoder here shares (a family's config adds its heads)
WIDTH = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2)
DECODER = dict(
    WIDTH, num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=64
)
#: 4 query heads over 2 key/value heads, for the tests that build a family's config themselves
GQA = dict(WIDTH, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
_MOE = dict(DECODER, intermediate_size=24)
_ROUTED = dict(_MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

FAMILIES = {
    "llama": ("LlamaConfig", "AutoModelForCausalLM", DECODER),
    "mistral": ("MistralConfig", "AutoModelForCausalLM", dict(DECODER, sliding_window=None)),
    "qwen2": ("Qwen2Config", "AutoModelForCausalLM", DECODER),  # q/k/v biases
    "qwen3": ("Qwen3Config", "AutoModelForCausalLM", dict(DECODER, tie_word_embeddings=True)),
    "mixtral": (
        "MixtralConfig",
        "AutoModelForCausalLM",
        dict(_MOE, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "AutoModelForCausalLM",
        dict(_ROUTED, decoder_sparse_step=1, mlp_only_layers=[1]),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "AutoModelForCausalLM",
        dict(_ROUTED, shared_expert_intermediate_size=12, norm_topk_prob=False),
    ),
    # MLA (q_lora_rank set; None in tests/test_nn_parallelize_deepseek.py) + DeepSeekMoE
    "deepseek_v3": (
        "DeepseekV3Config",
        "AutoModelForCausalLM",
        dict(
            _MOE,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=12,
            kv_lora_rank=10,
            qk_rope_head_dim=4,
            head_dim=4,  # the rotary width: qk_rope_head_dim
            qk_nope_head_dim=6,
            v_head_dim=5,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        "AutoModelForCausalLM",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    ),
    "bert": (
        "BertConfig",
        "AutoModelForMaskedLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
        ),
    ),
}


def config(family: str, **overrides):
    cls_name, _, kwargs = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    # no dropout: runs must be reproducible across layouts
    for key in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "attention_dropout",
    ):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    cfg._attn_implementation = "eager"
    return cfg


def build(family: str, seed: int = 0, **overrides):
    """The model of ``family`` drawn under ``seed`` (the same on every rank)."""
    _, auto, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config(family, **overrides))
    return model.float()


def stablelm(vocab: int, seed: int = 0):
    """A tiny StableLM (a LayerNorm per head, 4 heads) of ``vocab`` tokens, drawn under
    ``seed``."""
    cfg = transformers.StableLmConfig(
        **{**WIDTH, "vocab_size": vocab},
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.StableLmForCausalLM(cfg).float()


def max_tp(family: str) -> int:
    heads = FAMILIES[family][2].get("num_key_value_heads") or FAMILIES[family][2].get(
        "n_head", FAMILIES[family][2].get("num_attention_heads")
    )
    return heads


def exact(model):
    """A float64 copy of the HF ``model`` (same weights): the exact math of its single-process
    run (``fastpar.tolerance.cast``: its MoE experts in HF's eager loop, which has float64)."""
    return cast(copy.deepcopy(model), torch.float64)


def batch(family: str, step: int, rows: int = 4, seq: int = 12):
    """Step ``step``'s (ids, labels): the ids themselves (a causal LM), 3 labelled positions a
    row for BERT."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    if family == "bert":  # masked LM: 3 labelled positions per row (replicas average alike)
        labels = torch.full_like(ids, -100)
        for r in range(rows):
            pos = torch.randperm(seq, generator=g)[:3]
            labels[r, pos] = ids[r, pos]
        return ids, labels
    return ids, ids


def lm_loss(family: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's ``labels=`` loss written out in the logits' dtype (HF's casts the logits to
    fp32, which would make the float64 reference only as exact as fp32)."""
    if family != "bert":  # causal: token t predicts t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def loss_of(family: str, model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``lm_loss`` of ``model`` on ``ids``."""
    return lm_loss(family, model(input_ids=ids).logits, labels)


def dense_runs(family: str, dense, ids: torch.Tensor, labels: torch.Tensor) -> list:
    """The dense model's (logits, loss, gradients by name, ties under each name) on one batch:
    its fp32 run, its twin (every weight one ulp away: ``nudge``) and its float64 run."""
    twin = copy.deepcopy(dense)
    nudge(twin, seed=1)
    runs = []
    for model in (copy.deepcopy(dense), twin, exact(dense)):
        logits = model(input_ids=ids).logits
        loss = lm_loss(family, logits, labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        runs.append((logits.detach(), loss.detach(), grads))
    return runs


def agree_runs(actual, runs: list, pick, what: str, length: int, cut=lambda t: t) -> None:
    """The rule on ``actual`` against ``pick(run)`` of the fp32 run and its twin, and of the
    float64 run (each ``cut`` to this rank's part)."""
    single, twin, exact64 = (cut(pick(run)) for run in runs)
    agree(actual, [single, twin], exact64, what, length=length)


def longest_reduction(family: str) -> int:
    """The longest reduction of the tests' quantities: the batch's tokens or the widest
    parameter dimension (the vocabulary here)."""
    return reduction_length(build(family), batch(family, 0)[0])


def agree_grads(par, runs: list, length: int, tp_group=None) -> int:
    """Every gradient of the parallelized ``par`` (each name of a tied parameter) against its
    part of the dense runs' (``local_part``); with ``tp_group``, each replicated one also
    the same bits on every rank of it. Returns how many were judged."""
    count = 0
    for name, p in par.named_parameters(remove_duplicate=False):
        assert p.grad is not None, f"{name} got no gradient"
        cut = lambda t, p=p: local_part(t, p)  # noqa: E731
        agree_runs(p.grad, runs, lambda r, k=name: r[2][k], f"grad of {name}", length, cut)
        layout = param_layout(p)
        if tp_group is not None and (layout is None or layout.kind == "replicated"):
            same_on_every_rank(p.grad, tp_group, f"grad of replicated {name}")
        count += 1
    return count


def generate_at_tp2(family: str) -> list:
    """On each of 2 ranks: greedy ``generate`` of the model split over TP 2 (its KV cache holds
    the local heads) equals the dense model's; returns the ids."""
    from _mesh import make_mesh

    from fastpar import parallelize

    dense = build(family)
    par = parallelize(copy.deepcopy(dense), mesh=make_mesh(tp=2))
    ids, _ = batch(family, 0, rows=2, seq=5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want, got = dense.generate(ids, **kw), par.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)
    return got.tolist()


def readme_plan() -> dict:
    """The plan of docs/hf.md's example (``PLAN = {...}``, a plan of one's own), as written."""
    import ast
    import pathlib

    lines = (pathlib.Path(__file__).parents[1] / "docs" / "hf.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("PLAN = {"))
    last = next(i for i in range(first, len(lines)) if lines[i].strip() == "}")
    body = [line.split("  #")[0] for line in lines[first : last + 1]]
    return ast.literal_eval("\n".join(body).removeprefix("PLAN = "))
