"""Context-parallel runs against the single process, judged by ``fastpar.tolerance``'s rule.

Attention (``attention_runs``, ``agree_attention``): the single-process attention on the whole
sequence in fp32, its twin (inputs one ulp away) and float64, each cut to this rank's tokens,
against a cp rank's output and dq, dk, dv.

The models (``model``, ``references``, ``cp_step``): the GPT or Llama-class model on this rank's
tokens, its loss averaged over the cp group and every parameter's gradient averaged over it
(what data parallelism over dp x cp takes) against the single-process model's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from _mesh import make_mesh
from _parity import exact_copy, local_part

from fastpar.models import GPTConfig, LlamaConfig, build_gpt, build_llama, lm_loss
from fastpar.models.documents import Documents, documents
from fastpar.models.llama import routed
from fastpar.nn.marks import param_layout
from fastpar.parallel.context import split_sequence
from fastpar.parity import reduction_length
from fastpar.tolerance import assert_agree, nudge

VOCAB, SEQ = 53, 16


# -- attention ------------------------------------------------------------------------------
def _attention_run(attend: Callable, q, k, v, g, dtype=torch.float32, twin=False):
    """``attend(q, k, v)`` on the whole sequence in ``dtype`` (``twin``: q, k, v moved one ulp
    first), backward from ``sum(out * g)``: (output, [dq, dk, dv]), each of this rank's
    tokens."""
    leaves = [t.to(dtype).clone() for t in (q, k, v)]
    if twin:
        nudge(leaves, seed=1)
    leaves = [t.requires_grad_() for t in leaves]
    out = attend(*leaves)
    (out * g.to(dtype)).sum().backward()
    mine = lambda t: split_sequence(t.detach(), None, dim=2)  # noqa: E731
    return mine(out), [mine(t.grad) for t in leaves]


def attention_runs(attend: Callable, q, k, v, g) -> tuple[list, tuple]:
    """``attend``'s runs on the whole sequence: [fp32, its twin] and float64, each (output,
    [dq, dk, dv]) of this rank's tokens."""
    runs = [_attention_run(attend, q, k, v, g), _attention_run(attend, q, k, v, g, twin=True)]
    return runs, _attention_run(attend, q, k, v, g, torch.float64)


def agree_attention(out, mine, runs, exact, length: int, what: str) -> None:
    """This rank's ``out`` and the gradients of its ``mine`` = [q, k, v] against the fp32 run
    and its twin (``runs``) and the float64 run (``exact``) of ``attention_runs``."""
    assert_agree(out, [r[0] for r in runs], exact[0], length=length, what=f"output, {what}")
    for i, (name, got) in enumerate(zip("qkv", mine, strict=True)):
        assert_agree(
            got.grad, [r[1][i] for r in runs], exact[1][i], length=length, what=f"d{name}, {what}"
        )


# -- the models ----------------------------------------------------------------------------------
def model(kind: str, mesh, extra: dict):
    """(config, model): the 2-block GPT or Llama (``kind``) of ``extra``'s options, drawn
    under seed 0 (the same full weights on every rank)."""
    extra = {k: v for k, v in extra.items() if k != "ignored"}
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2, **extra)
    if kind == "llama":
        cfg = routed(LlamaConfig, **base)
        return cfg, torch.nn.Sequential(*build_llama(cfg, mesh))
    cfg = routed(GPTConfig, **base)
    return cfg, torch.nn.Sequential(*build_gpt(cfg, mesh))


def token_ids(ignored: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [2, SEQ] and targets: the ids, the first ``ignored`` positions -100."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    targets = ids.clone()
    targets[:, :ignored] = -100
    return ids, targets


def _inside(docs) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if docs is None else documents(Documents.of(docs))


def references(kind: str, extra: dict, docs=None):
    """The single-process model's loss and gradients (in this process: no process group),
    inside the documents ``docs`` if given, each a list of three runs: fp32, its twin (every
    weight one ulp away) and float64; and the longest reduction."""
    cfg, ref = model(kind, None, extra)
    twin, exact = exact_copy(ref).float(), exact_copy(ref)
    nudge(twin, seed=1)
    ids, targets = token_ids(extra.get("ignored", 0))
    losses, grads = [], []
    for m in (ref, twin, exact):
        with _inside(docs):
            loss = lm_loss(m(ids), targets, cfg)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    return losses, grads, reduction_length(ref, ids)


def cp_step(kind: str, layout: dict, extra: dict, docs, ref_losses, refs, length) -> int:
    """On this rank of ``layout``: one forward and backward of the model (inside ``docs`` if
    given); the loss and every gradient, each averaged over the cp group, against the single
    process's (``references``); a gradient held whole by every TP rank the same bits on each.
    Returns how many gradients were judged."""
    mesh = make_mesh(**layout)
    cfg, par = model(kind, mesh, extra)
    ids, targets = token_ids(extra.get("ignored", 0))
    with _inside(docs):
        loss = lm_loss(par(ids), targets, cfg, mesh)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=mesh.cp_group)
    where = f"cp rank {mesh.cp_rank}, tp rank {mesh.tp_rank}"
    what = f"loss (mean over cp) on {where}"
    assert_agree(mean / mesh.cp_size, ref_losses[:2], ref_losses[2], length=length, what=what)
    count = 0
    for name, p in par.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.cp_group)
        grad /= mesh.cp_size
        single, twin, exact = (local_part(r[name], p) for r in refs)
        what = f"grad of {name} (mean over cp) on {where}"
        assert_agree(grad, [single, twin], exact, length=length, what=what)
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
