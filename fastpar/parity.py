"""``check_parallel``: prove a parallel layout of YOUR model equal to the single-process model.

    report = check_parallel(lambda: MyModel(cfg), plan=None, tp=2, dp=2, zero=1, steps=3)
    assert report.ok, report.text

What it compares and against what: docs/layouts.md ("What fastpar.verify and check_parallel
compare")."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fastpar import tolerance
from fastpar.comm import plain
from fastpar.tolerance import Comparison

ADAM_EPS = 1e-4
"""AdamW's eps for the check. Adam's update lr · m / (sqrt(v) + eps) turns a gradient error δ
into a parameter error of up to a few lr · δ / (sqrt(v) + eps): where a gradient is zero up to
rounding (a key bias: softmax ignores it) rounding chooses the step, in every run alike, and
the rule allows it there (``fastpar.tolerance.adam_slack``) — so such elements prove nothing. The
larger eps, the fewer of them: at 1e-4 only gradients below about 1e-4 are so treated, while
larger ones are normalised as usual and checked tightly."""


@dataclass
class CheckReport:
    """``ok``; per part the worst ``fastpar.tolerance.Comparison`` (its ``what`` names the
    quantity); per-step losses (parallel, single-process fp32, float64); the text."""

    ok: bool
    layout: str
    logits: Comparison
    loss: Comparison
    worst_grad: Comparison
    losses: list[tuple[float, float, float]]
    worst_loss: Comparison
    worst_param: Comparison
    length: int
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
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())


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


def _in_dtype(batch_fn: Callable[[int], object], dtype: torch.dtype) -> Callable[[int], object]:
    """``batch_fn`` with its floating-point tensors cast to ``dtype`` (ids stay integers)."""

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return lambda step: tree_map(cast, batch_fn(step))


def reduction_length(model: nn.Module, batch) -> int:
    """The longest sum the check's quantities come from, for the rule's floor: the tokens of the
    batch (a weight gradient sums over them) or the widest parameter dimension (a matrix
    product's inner dimension, a vocabulary), whichever is longer."""
    tokens = max(
        (t.numel() for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)), default=1
    )
    widest = max((max(p.shape, default=1) for p in model.parameters()), default=1)
    return max(1, tokens, widest)


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from fastpar.checkpoint.state import localize

    return localize(full, p)


def _first_batch(batch, loss):
    """``before`` of the reference runs: (logits, loss, gradients by name) on batch 0."""

    def before(model: nn.Module, dtype: torch.dtype):
        first = _in_dtype(batch, dtype)(0)
        logits = _forward_logits(model, first).detach()
        model.zero_grad()
        value = loss(model, first)
        value.backward()
        grads = {
            n: (p.grad.detach().clone() if p.grad is not None else None)
            for n, p in model.named_parameters(remove_duplicate=False)
        }
        return logits, float(value.detach()), grads

    return before


def _worst(comparisons, empty: str) -> Comparison:
    found = tolerance.worst(comparisons)
    return found if found is not None else Comparison(empty, 0.0, 0.0, 0.0)


def _rank(
    build_model,
    plan,
    tp,
    zero,
    steps,
    seed,
    batch,
    loss,
    lr,
    weight_decay,
    pkw,
    refs: tolerance.References,
):
    from fastpar import ParallelMesh, parallelize
    from fastpar.nn.plans import builtin_plan
    from fastpar.optim import FusedAdamW
    from fastpar.parallel import DistributedDataParallel
    from fastpar.zero import Zero3, ZeroOptimizer

    mesh = ParallelMesh(tp=tp)
    first_logits = refs.exact.before[0]

    def check(what, actual, pick, local=None):
        """``actual`` against ``pick(run.before)`` of the runs (sliced like ``local``)."""
        ones = [pick(r.before) for r in (refs.single, refs.twin)]
        ref = pick(refs.exact.before)
        if local is not None:
            ones, ref = [_local(t, local) for t in ones], _local(ref, local)
        return tolerance.compare(
            actual, ones, ref, length=refs.length, dtype=torch.float32, what=what
        )

    def adamw(params):
        return FusedAdamW(params, lr=lr, weight_decay=weight_decay, eps=ADAM_EPS)

    def build():
        torch.manual_seed(seed)
        model = build_model().float()
        # check_parallel proves every gradient over steps itself and reports what disagrees;
        # parallelize's own backward check would refuse first (parallelize_kwargs may ask it)
        # a family without a plan runs whole at tp 1: an empty plan (nothing to split)
        unplanned = tp == 1 and plan is None and builtin_plan(model) is None
        return parallelize(model, {} if unplanned else plan, mesh, **{"check": "forward", **pkw})

    # 1. tensor parallel alone, full batch: logits, loss, every gradient on this rank
    model = build()
    first = batch(0)
    logits = _forward_logits(model, first).detach()
    if logits.shape != first_logits.shape and tp > 1:  # vocabulary-split logits: gather them
        parts = [torch.empty_like(logits) for _ in range(tp)]
        plain.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
        logits = torch.cat(parts, -1)[..., : first_logits.shape[-1]]
    logits_cmp = check("logits", logits, lambda b: b[0])
    model.zero_grad()
    value = loss(model, first)
    value.backward()
    loss_cmp = check("loss", float(value.detach()), lambda b: b[1])
    grads = []
    for name, p in model.named_parameters(remove_duplicate=False):
        ref = refs.exact.before[2].get(name)
        if (p.grad is None) != (ref is None):
            grads.append(Comparison(f"{name} (gradient missing on one side)", math.inf, 0, 0))
        elif p.grad is not None:
            grads.append(check(name, p.grad, lambda b, n=name: b[2][n], local=p))
    grad_reduced = list(model.fastpar_plan.grad_reduced)
    del model

    # 2. data parallel + ZeRO: the per-step loss and the parameters after `steps` AdamW steps
    model = build()
    rows = next(t for t in tree_flatten(batch(0))[0] if isinstance(t, torch.Tensor)).shape[0]
    if rows % mesh.dp_size:
        raise ValueError(f"the batch has {rows} rows, not divisible by dp={mesh.dp_size}")
    per = rows // mesh.dp_size
    sl = (mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
    if zero == 3:  # Zero3's wrap unit: the repeated block, the largest ModuleList's element type
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
        policy = {"wrap": (type(max(lists, key=len)[0]),)} if lists else {"min_params": 1}
        engine = Zero3(model, adamw, mesh=mesh, **policy)
        forward, opt = engine, engine
    elif zero == 0:
        forward = DistributedDataParallel(model, mesh=mesh)
        opt = adamw(model.parameters())
    else:
        forward = model
        opt = ZeroOptimizer(adamw(model.parameters()), stage=zero, mesh=mesh)
    losses, step_cmps = [], []
    for step in range(steps):
        value = loss(forward, _rows(batch(step), *sl))
        value.backward()
        opt.step()
        opt.zero_grad()
        mean = value.detach().float().reshape(1).clone()
        plain.all_reduce(mean, group=mesh.dp_group)
        mean = float(mean) / mesh.dp_size
        losses.append((mean, refs.single.losses[step], refs.exact.losses[step]))
        step_cmps.append(refs.loss(step, mean))
    ctx = engine.summon_full_params() if zero == 3 else contextlib.nullcontext()
    with ctx:
        named = dict(model.named_parameters())
        refs.local = lambda t, n: _local(t, named[n])  # this rank's slice of each tensor
        # (AdamW amplifies the gradients' rounding: ``param`` allows what it makes of them)
        params = [refs.param(name, p.detach()) for name, p in named.items()]
    return (
        logits_cmp,
        loss_cmp,
        _worst(grads, "-"),
        losses,
        _worst(step_cmps, "-"),
        _worst(params, "-"),
        grad_reduced,
    )


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
    length: int | None = None,
) -> CheckReport:
    """Run the layout (``tp * dp`` CPU ranks) beside the single-process model in fp32 and in
    float64; see docs/layouts.md. ``build_model()`` must build the same model every time
    it is called under the same seed (it is called under ``torch.manual_seed(seed)``; it may
    build in any dtype: the runs cast it). ``length``: the longest reduction for the rule's
    floor (default ``reduction_length``). Returns a ``CheckReport``."""
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
    if length is None:
        length = reduction_length(probe_model, batch(0))
    del probe_model
    # the single-process run in fp32, its twin and the float64 run (fastpar.tolerance)
    refs = tolerance.train_references(
        build_model,
        lambda model, step, dtype: loss(model, _in_dtype(batch, dtype)(step)),
        steps,
        length=length,
        seed=seed,
        lr=lr,
        weight_decay=weight_decay,
        eps=ADAM_EPS,
        before=_first_batch(batch, loss),
    )
    results = run_ranks(
        _rank,
        tp * dp,
        build_model,
        plan,
        tp,
        zero,
        steps,
        seed,
        batch,
        loss,
        lr,
        weight_decay,
        dict(parallelize_kwargs or {}),
        copy.deepcopy(refs),
        timeout=timeout,
    )
    logits, loss_cmp, worst_grad, _, worst_loss, worst_param, _ = (
        _worst([r[i] for r in results], "-") if i not in (3, 6) else None for i in range(7)
    )
    losses, grad_reduced = results[0][3], results[0][6]
    parts = (logits, loss_cmp, worst_grad, worst_loss, worst_param)
    ok = all(c.ok for c in parts)
    layout = f"tp {tp} x dp {dp}, ZeRO-{zero}" if zero else f"tp {tp} x dp {dp}, DDP"

    def line(label: str, c: Comparison) -> str:
        return (
            f"  {label}: {c.what}, error {c.error:.2e} <= {c.bound:.2e}? {'yes' if c.ok else 'NO'}"
        )

    lines = [
        f"check_parallel: {layout}, {steps} AdamW steps (eps {ADAM_EPS:g}), fp32",
        f"  {tolerance.rule_text(torch.float32, length)}",
        line("tensor parallel, first batch", logits),
        line("loss", loss_cmp),
        line("worst gradient", worst_grad),
    ]
    if grad_reduced:
        lines.append(f"  gradients all-reduced over TP (per-head): {len(grad_reduced)} parameters")
    lines.append(f"  {'step':>5} {'parallel':>12} {'single fp32':>12} {'float64':>12}")
    lines += [
        f"  {i + 1:>5} {a:>12.6f} {b:>12.6f} {c:>12.6f}" for i, (a, b, c) in enumerate(losses)
    ]
    lines.append(line("worst step loss", worst_loss))
    lines.append(line(f"worst parameter after {steps} steps", worst_param))
    lines.append("AGREE" if ok else "DISAGREE")
    return CheckReport(
        ok,
        layout,
        logits,
        loss_cmp,
        worst_grad,
        losses,
        worst_loss,
        worst_param,
        length,
        grad_reduced,
        "\n".join(lines),
    )


# -- python -m fastpar.verify --hf-config config.json -------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import sys

    from fastpar.cliutil import Parser
    from fastpar.launch import RankError

    ap = Parser(
        prog="python -m fastpar.verify --hf-config",
        description="Prove a layout of a Hugging Face model (from its config.json, random init) "
        "equal to the single-process model on CPU ranks; exit 0 only if they agree.",
    )
    ap.add_argument("--hf-config", required=True, help="a Hugging Face config.json")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    ap.add_argument(
        "--zero",
        type=int,
        default=1,
        choices=(0, 1, 2, 3),
        help="0: DDP, 1/2: ZeroOptimizer, 3: Zero3 (default 1)",
    )
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    ap.add_argument("--seq-len", type=int, default=16, help="tokens per row (default 16)")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows of the global batch (default 4 per replica)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        from fastpar.models.hf import model_builder

        build = model_builder(args.hf_config)
        rows = args.batch_size if args.batch_size is not None else 4 * args.dp
        if rows % args.dp:
            raise ValueError(f"--batch-size {rows} is not divisible by --dp {args.dp}")
        report = check_parallel(
            build,
            tp=args.tp,
            dp=args.dp,
            zero=args.zero,
            steps=args.steps,
            seed=args.seed,
            rows=rows // args.dp,
            seq=args.seq_len,
        )
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:  # the plan was refused on the ranks (parallelize's message)
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(report.text)
    return 0 if report.ok else 1
