"""``check_parallel``: prove a parallel layout of YOUR model equal to the single-process model.

    from fastpar.testing import check_parallel
    report = check_parallel(lambda: MyModel(cfg), plan=None, tp=2, dp=2, zero=1, steps=3)
    print(report.text)
    assert report.ok

On ``tp * dp`` CPU ranks (gloo) beside a single-process reference built by the same
``build_model`` under the same seed:

1. the tensor-parallel model (``fastpar.parallelize`` with ``plan``, default the built-in plan
   of the model's family) on the full first batch: its logits and loss equal the dense model's,
   and every parameter's gradient on every rank equals its slice of the dense gradient —
   replicated parameters included (a per-head norm's partial gradient shows here);
2. ``steps`` AdamW steps with the data-parallel wrapper of ``zero`` (0: DDP, 1 / 2: ZeroOptimizer,
   3: Zero3) on each replica's slice of the batch: the per-step loss (averaged over the
   replicas) and every parameter afterwards equal single-process AdamW on the full batch.

The report names the worst parameter of each part. Data: ``batch(step)`` returns the global
batch of a step (a tensor, tuple or dict whose tensors split along dim 0 over the DP
replicas); by default token ids for a language model. ``loss(model, batch)`` returns the
scalar loss; by default a Hugging Face model's own ``labels=`` loss, else next-token
cross-entropy of the logits.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

TOLERANCE = {"logits": 1e-5, "grad": 1e-5, "param": 1e-4, "loss": 1e-5}
"""fp32 tolerances (absolute and relative alike); parameters after AdamW steps are looser, as
in ``fastpar.verify``."""
ADAM_EPS = 1e-6
"""AdamW's eps for the check. Adam divides by sqrt(v) + eps, so a gradient that is zero up to
rounding (a key bias: softmax ignores it) becomes a step of up to lr · g / eps; with the usual
1e-8 two correct runs whose rounding differs drift apart by ~lr per step, with 1e-6 they do not,
while real gradients (far above 1e-6) are normalised as usual."""


@dataclass
class CheckReport:
    """``ok``; per part the worst (difference, parameter name); per-step losses; the text."""

    ok: bool
    layout: str
    logits_diff: float
    loss_diff: float
    worst_grad: tuple[float, str]
    losses: list[tuple[float, float]]
    worst_param: tuple[float, str]
    grad_reduced: list[str] = field(default_factory=list)
    text: str = ""


def _default_batch(model: nn.Module, rows: int, seq: int) -> Callable[[int], dict | torch.Tensor]:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    hf = isinstance(vocab, int)
    if not hf:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            raise ValueError(
                f"check_parallel: cannot make a batch for {type(model).__name__} (no config."
                "vocab_size and no nn.Embedding); pass batch=lambda step: ... and loss=..."
            )
        vocab = emb.num_embeddings

    def batch(step: int):
        g = torch.Generator().manual_seed(10_000 + step)
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        return {"input_ids": ids, "labels": ids} if hf else ids

    return batch


def _default_loss(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None:
            raise ValueError("the model returned no .loss for the batch: pass loss=")
        return loss
    logits = _logits(model(batch))
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())


def _logits(out) -> torch.Tensor:
    to_tuple = getattr(out, "to_tuple", None)
    if callable(to_tuple):
        logits = getattr(out, "logits", None)
        if logits is not None:
            return logits
        out = to_tuple()
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() >= 2]
    if not flat:
        raise ValueError("the model returned no tensor of logits")
    return flat[0]


def _forward_logits(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, Mapping):
        batch = {k: v for k, v in batch.items() if k != "labels"}
        return _logits(model(**batch))
    return _logits(model(*batch) if isinstance(batch, tuple) else model(batch))


def _rows(batch, start: int, stop: int):
    return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) else t, batch)


def _batch_size(batch) -> int:
    return next(t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)).shape[0]


def _block_type(model: nn.Module) -> type | None:
    """The repeated block (the element type of the largest ModuleList): Zero3's wrap unit."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    return type(max(lists, key=len)[0]) if lists else None


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from fastpar.checkpoint.state import localize

    return localize(full.float(), p)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (1 + max |b|): absolute near zero, relative for large values."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float()).abs().max() / (1.0 + b.float().abs().max()))


def _reference(build_model, seed, batch, loss, steps, lr, weight_decay):
    torch.manual_seed(seed)
    model = build_model().float()
    first = batch(0)
    logits = _forward_logits(model, first).detach()
    model.zero_grad()
    loss0 = loss(model, first)
    loss0.backward()
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else None)
        for n, p in model.named_parameters(remove_duplicate=False)
    }
    model.zero_grad()
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=weight_decay, eps=ADAM_EPS, foreach=False
    )
    losses = []
    for step in range(steps):
        value = loss(model, batch(step))
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(value.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return logits, float(loss0.detach()), grads, losses, params


def _rank(build_model, plan, tp, zero, steps, seed, batch, loss, lr, weight_decay, pkw, ref):
    from fastpar import ParallelMesh, parallelize
    from fastpar.optim import FusedAdamW
    from fastpar.parallel import DistributedDataParallel
    from fastpar.zero import Zero3, ZeroOptimizer

    ref_logits, ref_loss, ref_grads, ref_losses, ref_params = ref
    mesh = ParallelMesh(tp=tp)

    def adamw(params):
        return FusedAdamW(params, lr=lr, weight_decay=weight_decay, eps=ADAM_EPS)

    def build():
        torch.manual_seed(seed)
        model = build_model().float()
        return parallelize(model, plan, mesh, **pkw)

    # 1. tensor parallel alone, full batch: logits, loss, every gradient on this rank
    model = build()
    first = batch(0)
    logits = _forward_logits(model, first).detach()
    if logits.shape != ref_logits.shape and tp > 1:  # vocabulary-split logits: gather them
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
        logits = torch.cat(parts, -1)[..., : ref_logits.shape[-1]]
    logits_diff = _diff(logits, ref_logits)
    model.zero_grad()
    value = loss(model, first)
    value.backward()
    loss_diff = abs(float(value.detach()) - ref_loss) / (1.0 + abs(ref_loss))
    worst_grad = (0.0, "")
    for name, p in model.named_parameters(remove_duplicate=False):
        expect = ref_grads.get(name)
        if (p.grad is None) != (expect is None):
            worst_grad = max(worst_grad, (math.inf, f"{name} (gradient missing on one side)"))
            continue
        if p.grad is not None:
            worst_grad = max(worst_grad, (_diff(p.grad, _local(expect, p)), name))
    grad_reduced = list(model.fastpar_plan.grad_reduced)
    del model

    # 2. data parallel + ZeRO: the per-step loss and the parameters after `steps` AdamW steps
    model = build()
    rows = _batch_size(batch(0))
    if rows % mesh.dp_size:
        raise ValueError(f"the batch has {rows} rows, not divisible by dp={mesh.dp_size}")
    per = rows // mesh.dp_size
    sl = (mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
    if zero == 3:
        block = _block_type(model)
        policy = {"wrap": (block,)} if block is not None else {"min_params": 1}
        engine = Zero3(model, lambda ps: adamw(ps), mesh=mesh, **policy)
        forward, opt = engine, engine
    elif zero == 0:
        forward = DistributedDataParallel(model, mesh=mesh)
        opt = adamw(model.parameters())
    else:
        forward = model
        opt = ZeroOptimizer(
            FusedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, eps=ADAM_EPS),
            stage=zero,
            mesh=mesh,
        )
    losses = []
    for step in range(steps):
        value = loss(forward, _rows(batch(step), *sl))
        value.backward()
        opt.step()
        opt.zero_grad()
        mean = value.detach().float().reshape(1).clone()
        dist.all_reduce(mean, group=mesh.dp_group)
        losses.append((float(mean) / mesh.dp_size, ref_losses[step]))
    ctx = engine.summon_full_params() if zero == 3 else _nullcontext()
    worst_param = (0.0, "")
    with ctx:
        for name, p in model.named_parameters():
            worst_param = max(worst_param, (_diff(p.detach(), _local(ref_params[name], p)), name))
    return logits_diff, loss_diff, worst_grad, losses, worst_param, grad_reduced


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _worst_over_ranks(values):
    return max(values, key=lambda v: v[0])


def check_parallel(
    build_model: Callable[[], nn.Module],
    plan: Mapping[str, object] | None = None,
    *,
    tp: int = 2,
    dp: int = 2,
    zero: int = 1,
    steps: int = 3,
    seed: int = 0,
    batch: Callable[[int], object] | None = None,
    loss: Callable[[nn.Module, object], torch.Tensor] | None = None,
    rows: int = 4,
    seq: int = 16,
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    parallelize_kwargs: Mapping | None = None,
    timeout: float = 300.0,
) -> CheckReport:
    """Run the layout (``tp * dp`` CPU ranks) beside the single-process model; see the module
    docstring. ``build_model()`` must build the same model every time it is called under the
    same seed (it is called under ``torch.manual_seed(seed)``). Returns a ``CheckReport``."""
    from fastpar.launch import run_ranks

    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if min(tp, dp, steps) < 1:
        raise ValueError(f"tp, dp and steps must be >= 1, got tp={tp} dp={dp} steps={steps}")
    torch.manual_seed(seed)
    probe_model = build_model()
    if batch is None:
        batch = _default_batch(probe_model, rows * dp, seq)
    if loss is None:
        loss = _default_loss
    del probe_model
    ref = _reference(build_model, seed, batch, loss, steps, lr, weight_decay)
    results = run_ranks(
        _rank, tp * dp, build_model, plan, tp, zero, steps, seed, batch, loss, lr, weight_decay,
        dict(parallelize_kwargs or {}), copy.deepcopy(ref), timeout=timeout,
    )  # fmt: skip
    logits_diff = max(r[0] for r in results)
    loss_diff = max(r[1] for r in results)
    worst_grad = _worst_over_ranks([r[2] for r in results])
    worst_param = _worst_over_ranks([r[4] for r in results])
    losses = results[0][3]
    ok = (
        logits_diff <= TOLERANCE["logits"]
        and loss_diff <= TOLERANCE["loss"]
        and worst_grad[0] <= TOLERANCE["grad"]
        and worst_param[0] <= TOLERANCE["param"]
        and all(abs(a - b) / (1 + abs(b)) <= TOLERANCE["loss"] for a, b in losses)
    )
    layout = f"tp {tp} x dp {dp}, ZeRO-{zero}" if zero else f"tp {tp} x dp {dp}, DDP"
    lines = [
        f"check_parallel: {layout}, {steps} AdamW steps (eps {ADAM_EPS:g}), fp32; differences "
        "are |a - b| / (1 + |reference|)",
        f"  tensor parallel, first batch: logits {logits_diff:.2e}, loss {loss_diff:.2e}",
        f"  worst gradient: {worst_grad[0]:.2e} ({worst_grad[1] or '-'}), tolerance "
        f"{TOLERANCE['grad']:.0e}",
    ]
    if results[0][5]:
        lines.append(f"  gradients all-reduced over TP (per-head): {len(results[0][5])} parameters")
    lines.append(f"  {'step':>5} {'parallel':>12} {'single-process':>15}")
    lines += [f"  {i + 1:>5} {a:>12.6f} {b:>15.6f}" for i, (a, b) in enumerate(losses)]
    lines.append(
        f"  worst parameter after {steps} steps: {worst_param[0]:.2e} ({worst_param[1] or '-'}), "
        f"tolerance {TOLERANCE['param']:.0e}"
    )
    lines.append("AGREE" if ok else "DISAGREE")
    return CheckReport(
        ok, layout, logits_diff, loss_diff, worst_grad, losses, worst_param, results[0][5],
        "\n".join(lines),
    )  # fmt: skip


# -- python -m fastpar.verify --hf-config config.json -------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from fastpar.launch import RankError

    ap = argparse.ArgumentParser(
        prog="python -m fastpar.verify --hf-config",
        description="Prove a layout of a Hugging Face model (from its config.json, random init) "
        "equal to the single-process model on CPU ranks; exit 0 only if they agree.",
    )
    ap.add_argument("--hf-config", required=True, help="a Hugging Face config.json")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3),
                    help="0: DDP, 1/2: ZeroOptimizer, 3: Zero3 (default 1)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    ap.add_argument("--seq-len", type=int, default=16, help="tokens per row (default 16)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="rows of the global batch (default 4 per replica)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        from fastpar.models.hf import model_builder

        build = model_builder(args.hf_config)
        rows = args.batch_size if args.batch_size is not None else 4 * args.dp
        if rows % args.dp:
            raise ValueError(f"--batch-size {rows} is not divisible by --dp {args.dp}")
        report = check_parallel(
            build, tp=args.tp, dp=args.dp, zero=args.zero, steps=args.steps, seed=args.seed,
            rows=rows // args.dp, seq=args.seq_len,
        )  # fmt: skip
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:  # the plan was refused on the ranks (parallelize's message)
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(report.text)
    return 0 if report.ok else 1
