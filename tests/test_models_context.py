"""The GPT and Llama-class models under context parallelism, one forward and backward, against
the single-process model on the same batch: the loss, and every parameter's gradient on every
rank — each cp rank's gradient is its tokens' share of the sequence's mean loss, so the mean
over the cp group (what data parallelism over dp × cp takes) must equal the single-process
gradient; TP-sharded parameters against their slice, and copies held by several ranks (norms,
routers, replicated experts) must agree after that mean. Covers cp 2 and 4, cp × TP with and
without SP, GQA, MoE blocks (aux loss and z-loss: their gradient is weighted × cp) and the
all-to-all attention.

Not bit for bit: ring attention merges its blocks with an online softmax and the cp ranks'
gradients are summed by an all-reduce, in another order than the single process's sums. Each
quantity is judged by ``fastpar.tolerance``'s rule: against the single-process model in float64
(plain attention), with the fp32 model and its twin (weights one ulp away) as the measure of
rounding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh
from _parity import exact_copy, local_slice

from fastpar.models import GPTConfig, LlamaConfig, build_gpt, build_llama, lm_loss
from fastpar.nn.marks import param_layout
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import assert_agree, nudge

VOCAB, SEQ = 53, 16
CASES = {
    "gpt-cp2": ("gpt", dict(cp=2), {}),
    "llama-gqa-cp4": ("llama", dict(cp=4), dict(kv_heads=2)),
    "llama-cp2-tp2": ("llama", dict(cp=2, tp=2), dict(kv_heads=2)),
    "gpt-cp2-tp2-sp": ("gpt", dict(cp=2, tp=2), dict(sequence_parallel=True)),
    "llama-cp2-moe": ("llama", dict(cp=2), dict(moe_every=2, z_loss_coef=0.1, aux_loss_coef=0.3)),
    "llama-cp2-tp2-sp-moe": (
        "llama",
        dict(cp=2, tp=2),
        dict(moe_every=2, sequence_parallel=True, aux_loss="sequence"),
    ),
    "llama-cp2-a2a": ("llama", dict(cp=2), dict(kv_heads=2, cp_attention="all-to-all")),
    # ignored targets that fall unevenly on the cp ranks: the loss is still the sequence's mean
    "gpt-cp2-ignored": ("gpt", dict(cp=2), dict(ignored=5)),
    "llama-cp4-tp2-ignored": ("llama", dict(cp=4, tp=2), dict(ignored=3, kv_heads=2)),
}


def _model(kind: str, mesh, extra: dict):
    extra = {k: v for k, v in extra.items() if k != "ignored"}
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2, **extra)
    if kind == "llama":
        cfg = LlamaConfig(**base)
        return cfg, torch.nn.Sequential(*build_llama(cfg, mesh))
    cfg = GPTConfig(**base)
    return cfg, torch.nn.Sequential(*build_gpt(cfg, mesh))


def _ids(ignored: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [2, SEQ] and targets: the ids, the first ``ignored`` positions -100."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    targets = ids.clone()
    targets[:, :ignored] = -100
    return ids, targets


def _reference(kind: str, extra: dict):
    """The single-process model's loss and gradients (in this process: no process group), each
    a list of three runs: fp32, its twin (every weight one ulp away) and float64; and the
    longest reduction (``fastpar.parity.reduction_length``)."""
    cfg, ref = _model(kind, None, extra)
    twin, exact = exact_copy(ref).float(), exact_copy(ref)
    nudge(twin, seed=1)
    ids, targets = _ids(extra.get("ignored", 0))
    losses, grads = [], []
    for model in (ref, twin, exact):
        loss = lm_loss(model(ids), targets, cfg)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return losses, grads, reduction_length(ref, ids)


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    layout = param_layout(p)
    if layout is not None and layout.kind == "sharded":
        return local_slice(full, p, layout.fused)
    return full


def _step(kind: str, layout: dict, extra: dict, ref_losses, refs, length):
    mesh = make_mesh(**layout)
    cfg, model = _model(kind, mesh, extra)
    ids, targets = _ids(extra.get("ignored", 0))
    loss = lm_loss(model(ids), targets, cfg, mesh)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=mesh.cp_group)
    where = f"cp rank {mesh.cp_rank}, tp rank {mesh.tp_rank}"
    assert_agree(
        mean / mesh.cp_size,
        ref_losses[:2],
        ref_losses[2],
        length=length,
        what=f"loss (mean over cp) on {where}",
    )
    count = 0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.cp_group)
        grad /= mesh.cp_size
        single, twin, exact = (_local(r[name], p) for r in refs)
        assert_agree(
            grad,
            [single, twin],
            exact,
            length=length,
            what=f"grad of {name} (mean over cp) on {where}",
        )
        layout_ = param_layout(p)
        if layout_ is None or layout_.kind == "replicated":  # copies over TP agree
            # bit for bit: every TP rank computes these from the same inputs with the same
            # kernels (or receives the same all-reduced sum)
            copies = [torch.empty_like(grad) for _ in range(mesh.tp_size)]
            dist.all_gather(copies, grad, group=mesh.tp_group)
            assert all(torch.equal(c, grad) for c in copies), f"{name}: TP copies differ"
        count += 1
    assert count == len(refs[0])
    return count


@pytest.mark.parametrize("name", list(CASES))
def test_every_gradient_on_every_rank_equals_the_single_process_model(name):
    kind, layout, extra = CASES[name]
    world = layout["cp"] * layout.get("tp", 1)
    counts = run_ranks(_step, world, kind, layout, extra, *_reference(kind, extra))
    assert len(set(counts)) == 1 and counts[0] > 0
