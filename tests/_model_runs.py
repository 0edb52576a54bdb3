"""The runs fastpar's own models (Llama, DeepSeek) are judged against, by ``fastpar.tolerance``'s
rule: a model in fp32, its twin (every weight one ulp away) and its float64 copy (``three``,
``three_runs``), the single-process run a tensor-parallel one is compared with
(``single_process``, ``agree_tp_output``), and Hugging Face's model of a config
(``hf_model``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _parity import agree, exact_copy

from fastpar.comm import gather_from_region
from fastpar.moe.layer import aux_loss_scale
from fastpar.parity import reduction_length
from fastpar.tolerance import nudge

#: a tiny Llama (``LlamaConfig`` keywords) with a MoE block every second layer: the optimizers'
#: tests' model
MOE_LLAMA = dict(vocab_size=32, seq_len=8, hidden=16, heads=4, kv_heads=2, layers=2, moe_every=2)


def mla_sizes(q_lora_rank, kv_lora_rank: int, rope: int, nope: int, v: int) -> dict:
    """DeepSeek's latent attention widths as ``DeepSeekConfig`` keywords."""
    widths = dict(qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v)
    return dict(q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, **widths)


def deepseek_moe(first_k_dense: int, experts: int, top_k: int, ffn: int) -> dict:
    """DeepSeek's MoE blocks (after ``first_k_dense`` dense ones) as ``DeepSeekConfig``
    keywords."""
    return dict(first_k_dense=first_k_dense, num_experts=experts, top_k=top_k, moe_ffn=ffn)


def yarn(factor: float, original_seq_len: int, mscale_all_dim: float, **rest) -> dict:
    """YaRN's rotary scaling as ``DeepSeekConfig`` keywords (``rest``: ``yarn_mscale``...)."""
    return dict(
        yarn_factor=factor,
        yarn_original_seq_len=original_seq_len,
        yarn_mscale_all_dim=mscale_all_dim,
        **rest,
    )


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at one, biases at the layer's init, routers near-uniform (HF draws
    them from N(0, 0.02)) and expert biases at zero: move them, so that a swapped or missing
    norm, bias or router shows in the logits and gradients, and the experts' choice matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif "router" in name or name.endswith("mlp.gate.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.add_(0.1 * torch.randn(b.shape, generator=g))


def three(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """``model`` (fp32), its twin (every weight one ulp away) and its float64 copy: the runs the
    rule judges against (``fastpar.tolerance``)."""
    twin = exact_copy(model).float()
    nudge(twin, seed=1)
    return model, twin, exact_copy(model)


def agree_three(actual, runs, what: str, length: int):
    """``actual`` against the fp32 run and its twin (``runs[:2]``), float64 ``runs[2]``."""
    return agree(actual, list(runs[:2]), runs[2], what, length=length)


@torch.no_grad()
def logits_of(models, ids: torch.Tensor, shape) -> list[torch.Tensor]:
    """Each model's logits on ``ids`` (integer ids: the same input for every dtype)."""
    return [m(ids).view(shape) for m in models]


def without_aux_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``model(ids)`` with no router aux loss (HF's loss has none unless asked for one)."""
    with aux_loss_scale(None):
        return model(ids)


def three_runs(model: torch.nn.Module, ids, targets, loss: Callable, forward=None) -> tuple:
    """The logits, losses (``loss(out, targets)``) and gradients by name of the three runs of
    ``model`` on one batch; ``forward(m, ids)`` in place of ``m(ids)``."""
    logits, losses, grads = [], [], []
    for m in three(model):
        out = m(ids) if forward is None else forward(m, ids)
        value = loss(out, targets)
        value.backward()
        logits.append(out.detach())
        losses.append(value.detach())
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    return logits, losses, grads


def single_process(cfg, build: Callable, loss: Callable, buffers: bool = False):
    """In this (rank-less) process, the model ``build(cfg)`` drawn under seed 0: its initial
    weights, its moved weights (``perturb_``; with the buffers, by global name), a batch, the
    logits, loss (``loss(out, targets, cfg)``) and gradients of its three runs, and the longest
    reduction."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*build(cfg))
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    perturb_(model, 1)
    moved = model.state_dict() if buffers else dict(model.named_parameters())
    state = {k: v.detach().clone() for k, v in moved.items()}
    torch.manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    want = three_runs(model, ids, targets, lambda out, t: loss(out, t, cfg))
    return initial, state, (ids, targets), want, reduction_length(model, ids)


def agree_tp_output(out, targets, cfg, mesh, loss: Callable, want, length: int, where: str):
    """This TP rank's logits ``out`` (gathered over TP, the vocabulary's padding cut) and loss
    ``loss(out, targets, cfg, mesh)`` against the three runs' (``want``: logits, losses, ...);
    returns the loss."""
    full = gather_from_region(out, mesh.tp_group, dim=-1)[:, : cfg.vocab_size]
    agree_three(full, want[0], f"logits on {where}", length)
    value = loss(out, targets, cfg, mesh)
    agree_three(value, want[1], f"loss on {where}", length)
    return value


def against_hf(ours, hf, cfg, loss: Callable, map_grads: Callable) -> tuple:
    """HF's logits and loss (a cross-entropy) on 3 x 13 ids drawn under seed 5, against the
    three runs of fastpar's ``ours`` holding the same weights (``loss(out, targets, cfg)``, no
    aux loss); HF's loss backward. Returns the runs' gradients in HF's names
    (``map_grads``), HF's parameters by name (ties under each) and the longest reduction."""
    torch.manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (3, 13))
    targets = torch.randint(0, cfg.vocab_size, (3, 13))
    length = reduction_length(ours, ids)
    run_loss = lambda out, t: loss(out, t, cfg)  # noqa: E731
    logits, losses, grads = three_runs(ours, ids, targets, run_loss, without_aux_loss)
    want = hf(ids).logits
    agree_three(want.detach(), [x.view(3, 13, -1) for x in logits], "HF's logits", length)
    want_loss = torch.nn.functional.cross_entropy(want.flatten(0, 1), targets.flatten())
    agree_three(want_loss.detach(), losses, "HF's loss", length)
    want_loss.backward()
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    return [map_grads(g) for g in grads], hf_params, length


def check_from_hf(cfg, build: Callable, from_hf: Callable, hf_config: Callable, to_hf: Callable):
    """HF's model of ``cfg`` (drawn under seed 3, then ``perturb_``) read by ``from_hf``: the
    same config, HF's logits against fastpar's three runs of what it read, and mapped back by
    ``to_hf`` the same tensors under the same names, bit for bit (renamed or split copies)."""
    torch.manual_seed(3)
    hf = hf_model(hf_config(cfg))
    perturb_(hf, 4)
    hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    got_cfg, state = from_hf(hf_state, hf.config.to_dict())
    assert hf_config(got_cfg) == hf_config(cfg)
    model = torch.nn.Sequential(*build(got_cfg))
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad(), aux_loss_scale(None):
        runs = logits_of(three(model), ids, (2, 11, -1))
        agree_three(hf(ids).logits, runs, "HF's logits", reduction_length(model, ids))
    back = to_hf(state, got_cfg)
    assert set(back) == set(hf_state)
    for k, v in back.items():
        assert torch.equal(v, hf_state[k]), k


def check_mapping_refusals(state, cfg, to_hf, hf_config, from_hf, bad: dict) -> tuple:
    """``to_hf`` refuses a tensor with no HF name; ``from_hf`` refuses HF's llama3 RoPE and
    each config change of ``bad`` (message -> change) of ``to_hf(state, cfg)``. Returns HF's
    (state, config)."""
    with pytest.raises(ValueError, match=r"have no HF name.*\['9.extra'\]"):
        to_hf({**state, "9.extra": torch.zeros(1)}, cfg)
    hf_state, config = to_hf(state, cfg), hf_config(cfg)
    llama3 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    for message, change in {"rope_type 'llama3' is not supported": llama3, **bad}.items():
        with pytest.raises(ValueError, match=message):
            from_hf(hf_state, {**config, **change})
    return hf_state, config


def hf_model(cfg_dict: dict):
    """HF's model of the config, with its eager attention and experts (the plain per-expert
    loop; HF's default grouped_mm experts need widths that are multiples of 16 bytes on CPUs,
    and are what the from_pretrained tests run)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg_dict)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    return model.float().eval()
