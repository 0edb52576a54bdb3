"""``python -m fastpar.verify``: prove a layout equal to the single-process model.

    python -m fastpar.verify --tp 2 --pp 2 --dp 2 --ep 2 --zero 1 --steps 3
    python -m fastpar.verify --hf-config config.json --tp 2 --dp 2 --zero 1   # your HF model

Exit 0 only when the layout agrees with the reference (the trainer's own build without a mesh)
by the rule of docs/tolerances.md; what is compared: docs/layouts.md."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field

import numpy as np
import torch

from fastpar import checkpoint, parity, tolerance
from fastpar.launch import RankError
from fastpar.models.common import IGNORE_INDEX
from fastpar.models.documents import documents
from fastpar.models.mtp import tokens as mtp_tokens
from fastpar.parallel.pipeline.schedules import SCHEDULES
from fastpar.train import TrainConfig, batch_of, build_parser, launch, load_data, lr_at
from fastpar.train.batches import as_data, eval_batch, split_tokens
from fastpar.train.build import DTYPES, build
from fastpar.train.checks import flag
from fastpar.train.cli import prepare, refuse
from fastpar.train.config import flag_specs
from fastpar.train.loop import evaluates_at
from fastpar.train.options import CHECKPOINTS
from fastpar.train.summary import hybrid_text


def _val_loss(cfg: TrainConfig, parts, held) -> float:
    """The validation loss on one process, eval mode, each held-out batch in one piece: under
    "token" normalisation the sum of the loss over every valid target of every batch over
    their count; under "sequence" each batch's mean, averaged over the batches."""
    model, total, count = parts.module, 0.0, 0
    model.eval()
    with torch.no_grad():
        for j in range(cfg.eval_batches):
            x, y, docs = eval_batch(cfg, held, j, parts.hf)
            with documents(docs):
                logits = model(x)
            valid = int((y != IGNORE_INDEX).sum())
            loss = float(parts.loss_fn(logits, y))  # the sum over the batch's valid targets
            if cfg.loss_normalization == "token":
                total, count = total + loss, count + valid
            else:
                total, count = total + loss / max(1, valid), count + 1
    model.train()
    return total / max(1, count)


def reference_groups(cfg: TrainConfig) -> int:
    """How many pieces the reference runs a global batch in: 1 (the whole batch, one forward
    and backward) unless a statistic of the model is one of each micro-batch — MoE layers with
    the "micro_batch" load-balancing loss or a capacity (tokens dropped per micro-batch): then
    every micro-batch of every replica (dp × micro-batches pieces), as the layers define it.
    So does fp16: whether a step overflows (and is skipped) is decided on each rank's
    loss-scaled fp16 gradient, which the reference must then hold alike (each replica's
    pieces accumulated in fp16, the replicas averaged in fp32)."""
    if cfg.precision == "fp16":  # a skip is decided on each rank's loss-scaled gradient
        return cfg.dp * cfg.microbatches
    if cfg.hf_config or not cfg.model.moe_every:
        return 1
    per_micro_batch = (
        cfg.model.moe_router.aux_loss == "micro_batch" and cfg.model.moe_router.aux_loss_coef > 0
    ) or (cfg.model.capacity_factor is not None)
    return cfg.dp * cfg.microbatches if per_micro_batch else 1


@dataclass
class Run(tolerance.Run):
    """One single-process run (``fastpar.tolerance.Run``: per step the loss, the gradients by
    name and, for the exact run, AdamW's sqrt(v̂) + eps by name; the final tensors as
    ``Parts.checkpoint_tensors`` names them), and per step its gradient norm (before clipping),
    whether it was skipped (fp16: inf/NaN gradients) and its LR; the validation losses
    {step: loss}."""

    norms: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)


def reference(
    cfg: TrainConfig, tokens=None, *, exact: bool = False, twin: bool = False, skips=()
) -> Run:
    """Single-process training with the distributed run's math, built by the trainer's own code
    (docs/layouts.md, "What fastpar.verify and check_parallel compare"); only the step is
    written here, replica by replica. ``exact``: the same in float64 (skipping the steps
    ``skips`` names: an fp16 run's decisions); ``twin``: from starting weights one rounding
    away (``fastpar.tolerance.nudge``). The final tensors are the parameters and, with
    --expert-bias, every router's ``expert_bias`` (updated from every replica's tokens)."""
    groups = reference_groups(cfg)
    replicas = cfg.dp if groups > 1 else 1  # in pieces: each replica's micro-batches
    # one device's objective, whatever the run's: the mean over every valid target
    ref_cfg = dataclasses.replace(cfg, loss_normalization="token", microbatches=groups // replicas)
    parts = build(ref_cfg, None, torch.device("cpu"), exact=exact, twin=twin)
    model, opt = parts.module, parts.opt
    if exact:
        opt.skips = list(skips)
    tokens = load_data(cfg) if tokens is None else as_data(cfg, tokens)
    tokens, held = split_tokens(cfg, tokens)
    names = {id(p): n for n, p in parts.named_parameters().items()}
    params = list(model.parameters())
    acc_dtype = torch.float64 if exact else torch.float32
    run = Run()
    for step in range(cfg.steps):
        lr = lr_at(cfg, step)
        for g in parts.param_groups:
            g["lr"] = lr
        parts.update_aux_scale()  # (MoE: 1 / groups of the loss scale)
        x, y, docs = batch_of(cfg, tokens, step, parts.hf)
        count = int((y != IGNORE_INDEX).sum())
        if count == 0:  # the trainer skips a step with no valid target (nothing changes)
            run.grads.append(
                {names[id(p)]: torch.zeros_like(p, dtype=torch.float64) for p in params}
            )
            total, norm, skipped = 0.0, 0.0, True
            if exact:
                run.denominators.append(dict(run.denominators[-1]) if run.denominators else {})
        else:
            total, acc = 0.0, [torch.zeros_like(p, dtype=acc_dtype) for p in params]
            per, rows = groups // replicas, x.shape[0] // groups
            for r in range(replicas):
                opt.zero_grad()  # a replica's pieces accumulate in the model's dtype, as on a rank
                for piece in range(r * per, (r + 1) * per):
                    sl = slice(piece * rows, (piece + 1) * rows)
                    docs_sl = None if docs is None else docs.rows(sl)  # (packed rows)
                    with documents(docs_sl), mtp_tokens(x[sl]):  # (the ids MTP modules look up)
                        logits = model(x[sl])
                    # the sum over the global count, times the replicas their average divides by
                    loss = parts.loss_fn(logits, y[sl]) * (replicas / count)
                    opt.scale_loss(loss).backward()
                    total += float(loss.detach()) / replicas
                for a, p in zip(acc, params, strict=True):
                    if p.grad is not None:
                        a.add_(p.grad.to(acc_dtype), alpha=1.0 / replicas)
            for a, p in zip(acc, params, strict=True):
                p.grad = a.to(p.dtype)
            scale = float(opt.scaler.scale) if getattr(opt, "scaler", None) is not None else 1.0
            run.grads.append({names[id(p)]: p.grad.double() / scale for p in params})
            skipped, norm = opt.step()
            parts.update_expert_bias(skipped, None)  # the trainer's bias step (every replica)
            opt.zero_grad()
            if exact:
                run.denominators.append({names[id(p)]: d for p, d in opt.denominators[-1].items()})
        run.losses.append(total)
        run.norms.append(float(norm))
        run.skipped.append(bool(skipped))
        run.lrs.append(lr)
        if evaluates_at(cfg, step + 1):
            run.val_losses[step + 1] = _val_loss(cfg, parts, held)
    named = parts.checkpoint_tensors()  # parameters, and the routers' expert biases
    run.params = {name: p.detach().double().clone() for name, p in named.items()}
    if exact:  # (bf16 moments: what a neighbouring stored value moves each parameter by)
        run.rounding_slack = {names[id(p)]: s for p, s in opt.rounding_slack.items()}
    return run


def _distributed(cfg: TrainConfig, directory: str, tokens):
    cfg.checkpoint_dir, cfg.save_every, cfg.quiet = directory, cfg.steps, True
    records = launch(cfg, tokens=tokens)
    path = os.path.join(directory, f"step_{cfg.steps:06d}")
    out_file = os.path.join(directory, "export.pt")
    checkpoint.export_state_dict(path, out_file)
    state = torch.load(out_file, weights_only=True)
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    losses = [(r["loss"], r["grad_norm"]) for r in records]
    return losses, {k: v.double() for k, v in state.items()}, vals


def reduction_length(cfg: TrainConfig, params: dict[str, torch.Tensor]) -> int:
    """The longest sum a compared quantity comes from, for the rule's floor: the tokens of a
    global batch (a weight gradient sums over them) or the widest parameter dimension."""
    widest = max((max(t.shape, default=1) for t in params.values()), default=1)
    return max(1, cfg.batch_size * cfg.model.seq_len, widest)


def references(cfg: TrainConfig, tokens) -> tolerance.References:
    """The three single-process runs the rule needs (``fastpar.tolerance``): in the run's
    precision, its twin, and float64 (skipping the steps the first skipped); AdamW's slack uses
    each step's LR (0 for a skipped step)."""
    single = reference(cfg, tokens)
    twin = reference(cfg, tokens, twin=True)
    exact = reference(cfg, tokens, exact=True, skips=single.skipped)
    length = reduction_length(cfg, exact.params)
    lrs = [0.0 if skip else lr for skip, lr in zip(exact.skipped, exact.lrs, strict=True)]
    return tolerance.References(single, twin, exact, length, lrs, DTYPES[cfg.precision])


LAYOUT_ONLY = frozenset(
    {
        # the layout: how the same math is split over ranks
        *("tp", "pp", "dp", "ep", "cp", "cp_attention", "zero", "dp_shard", "dp_replicate"),
        *("schedule", "virtual_stages", "microbatch_group_size", "recompute"),
        *("sequence_parallel", "moe_expert_tp", "overlap_chunks", "compile"),
        # replaced in the reference: microbatches (by reference_groups), the normalisation
        *("microbatches", "loss_normalization"),
        # how a run is driven and what it writes
        *("quiet", "log_every", "metrics_file", "tensorboard", "peak_tflops", "profile"),
        *("profile_steps", "debug_checks", "collective_timeout", "on_save_error"),
        *("max_skipped_steps", "checkpoint_dir", "save_every", "keep_last", "resume"),
        *("allow_fresh", "allow_other_run", "allow_schedule_change"),
    }
)
"""The ``TrainConfig`` fields the single-process references never read (``reference`` builds
the model without a mesh, keeps every activation, runs eagerly): ``reference_key`` leaves them
out and keeps every other field."""


def _digest(data) -> str:
    """A fingerprint of the training data: the token ids and, for a ``Corpus``, its document
    starts and loss mask."""
    h = hashlib.sha256()
    parts = (data.tokens, data.starts, data.loss_mask) if hasattr(data, "starts") else (data,)
    for part in parts:
        if part is None:
            h.update(b"none")
            continue
        a = part.numpy() if isinstance(part, torch.Tensor) else np.asarray(part)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def reference_key(cfg: TrainConfig, tokens) -> tuple:
    """What ``references(cfg, tokens)`` depends on, and nothing else: every field of ``cfg``
    but ``LAYOUT_ONLY`` (the model, data, steps, precision, optimizer and its state dtype, LR
    schedule, seed, documents, MTP, fused CE, evaluation, ...), the pieces a global batch runs
    in (``reference_groups``: dp x micro-batches for fp16 and per-micro-batch MoE statistics,
    with the replicas those pieces make), whether the fused cross-entropy recomputes its
    logits in backward (it does under a schedule whose forwards all come first), and a
    fingerprint of the data (``tokens``: as ``compare`` takes them; None: ``load_data``)."""
    groups = reference_groups(cfg)
    fields = tuple((n, v) for n, v in cfg.flags().items() if n not in LAYOUT_ONLY)
    recomputes = SCHEDULES[cfg.schedule].forwards_first if cfg.fused_ce else None
    data = load_data(cfg) if tokens is None else tokens
    return fields, groups, cfg.dp if groups > 1 else 1, recomputes, _digest(data)


class ReferenceCache:
    """``references`` computed once per ``reference_key``: layouts whose single-process math is
    the same share one computation (``compare(..., cache=)``). Holds the last ``size`` keys'
    (run them one after the other); ``computed`` and ``hits`` count its answers."""

    def __init__(self, size: int = 4) -> None:
        self.size, self.computed, self.hits = size, 0, 0
        self._runs: dict[tuple, tolerance.References] = {}

    def references(self, cfg: TrainConfig, tokens) -> tolerance.References:
        key = reference_key(cfg, tokens)
        refs = self._runs.pop(key, None)
        if refs is None:
            refs = references(cfg, tokens)
            self.computed += 1
        else:
            self.hits += 1
        self._runs[key] = refs  # the newest last
        while len(self._runs) > self.size:
            del self._runs[next(iter(self._runs))]
        return refs


def check_precision(cfg: TrainConfig) -> None:
    """Refuse ``--precision fp8``: the float64 reference has no fp8 rounding, so the rule's
    bound would be the fp8 error itself, too wide to tell a wrong scale from a right one."""
    if cfg.precision == "fp8":
        raise ValueError(
            "fastpar.verify --precision fp8: its float64 reference has no fp8 rounding, so its "
            "bound could not tell a wrong fp8 scale from a right one; verify the layout with "
            "--precision bf16 (the fp8 layers are proven against one device by "
            "tests/test_fp8_linear.py)"
        )


def compare(
    cfg: TrainConfig, tokens=None, *, cache: ReferenceCache | None = None
) -> tuple[bool, str]:
    """Run both, return (agree, the report text). ``tokens``: the data, already checked
    (``fastpar.train.load_data``; None: load and check them here). Every quantity is judged by
    ``fastpar.tolerance``'s rule: the distributed run's error against a float64 run of the same
    math, at most a multiple of the single-process run's own (it and its twin one rounding
    away) plus a floor from the precision and the longest reduction. ``cache``: take the
    references from it (computed there once per ``reference_key``)."""
    cfg.check()
    tokens = load_data(cfg) if tokens is None else tokens
    with tempfile.TemporaryDirectory(prefix="fastpar-verify-") as directory:
        dist_losses, dist_params, dist_vals = _distributed(cfg, directory, tokens)
    refs = references(cfg, tokens) if cache is None else cache.references(cfg, tokens)
    single, twin, exact, dtype, length = refs.single, refs.twin, refs.exact, refs.dtype, refs.length

    def judge(what, actual, pick):
        return tolerance.compare(
            actual, [pick(single), pick(twin)], pick(exact), length=length, dtype=dtype, what=what
        )

    lines = [
        f"{cfg.model_name}, layout: dp {cfg.dp}{hybrid_text(cfg)} x tp {cfg.tp} x pp {cfg.pp}"
        f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} (ep {cfg.ep}), ZeRO-{cfg.zero}, {cfg.precision}, "
        f"{cfg.schedule_label} x {cfg.microbatches}{f', recompute {cfg.recompute_policy}' if cfg.recompute else ''}"
        f"{', sequence parallel' if cfg.model.sequence_parallel else ''}"
        f"{f', AdamW moments in {cfg.optimizer.state_dtype}' if cfg.optimizer.state_dtype != 'fp32' else ''}",
        tolerance.rule_text(dtype, length),
        f"{'step':>5} {'distributed':>14} {'single-process':>15} {'float64':>12} {'error/bound':>11}"
        f" {'grad-norm dist.':>15} {'single':>10} {'error/bound':>11}",
    ]
    ok = len(dist_losses) == len(single.losses)
    worst: list[tolerance.Comparison] = []
    for i, (a, na) in enumerate(dist_losses[: len(single.losses)]):
        c = refs.loss(i, a)
        worst.append(c)
        ok &= c.ok
        # a step skipped for inf/NaN gradients (fp16): both runs must skip it, and its norm is
        # not a number to compare; otherwise the norm before clipping (a gradient reduced twice
        # or lost moves it, AdamW would not)
        dist_skip, ref_skip = not math.isfinite(na), single.skipped[i]
        if dist_skip or ref_skip:
            ok &= dist_skip == ref_skip
            nc = "skipped" if dist_skip == ref_skip else "SKIP DIFFERS"
        else:
            n = judge(f"grad norm of step {i + 1}", na, lambda r, i=i: r.norms[i])
            worst.append(n)
            ok &= n.ok
            nc = f"{n.ratio:.2f}"
        lines.append(
            f"{i + 1:>5} {a:>14.6f} {single.losses[i]:>15.6f} {exact.losses[i]:>12.6f} "
            f"{c.ratio:>11.2f} {na:>15.6f} {single.norms[i]:>10.6f} {nc:>11}"
        )
    if exact.val_losses or dist_vals:
        ok &= sorted(exact.val_losses) == sorted(dist_vals)
        lines.append(
            f"{'step':>5} {'val_loss dist.':>14} {'single-process':>15} {'float64':>12}"
            f" {'error/bound':>11}"
        )
        for step, b in exact.val_losses.items():
            a = dist_vals.get(step, float("nan"))
            c = judge(f"validation loss at step {step}", a, lambda r, s=step: r.val_losses[s])
            worst.append(c)
            ok &= c.ok
            lines.append(
                f"{step:>5} {a:>14.6f} {single.val_losses[step]:>15.6f} {b:>12.6f} {c.ratio:>11.2f}"
            )
    missing = sorted(set(exact.params) - set(dist_params))
    if missing:
        ok = False
        lines.append(f"parameters missing from the distributed checkpoint: {missing[:5]}")
    params = []
    for name, ref in exact.params.items():
        got = dist_params.get(name)
        if got is None:
            continue
        if got.shape != ref.shape:
            ok = False
            lines.append(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
            continue
        params.append(refs.param(name, got))  # with what AdamW makes of the gradients' bounds
    if params:
        c = tolerance.worst(params)
        ok &= all(p.ok for p in params)
        lines.append(f"worst parameter: {c}")
    c = tolerance.worst(worst)
    if c is not None:
        lines.append(f"worst loss or norm: {c}")
    lines.append("AGREE" if ok else "DISAGREE")
    return ok, "\n".join(lines)


#: verify's own defaults (the trainer's flags, fewer steps); with --hf-config a smaller batch
DEFAULTS = {"steps": 3}
HF_DEFAULTS = {**DEFAULTS, "batch_size": 8, "seq_len": 16}
HELP = textwrap.fill(
    "Prove a layout equal to one process: train the model of python -m fastpar.train under the "
    "given layout (any of its flags), then the same model from the same initialisation on the "
    "same data in ONE process on the whole global batch, in the run's precision, its twin (one "
    "rounding away) and in float64; print both losses and gradient norms per step (and "
    "validation losses with --eval-every) and the largest parameter difference.",
    width=92,
)
EPILOG = f"""\
the tolerance rule (fastpar.tolerance):
  each quantity (loss, gradient norm, validation loss, every final parameter) is compared with
  the same math in float64: it agrees when its error is at most {tolerance.FACTOR:g} x the
  single-process run's own error (it and its twin) + {tolerance.FLOOR:g} (u + u32 sqrt(n))
  max|value| (u: the precision's unit roundoff, n: the longest reduction) + what AdamW makes
  of the gradients' bounds. fp32 is tight; bf16 / fp16 are loose.

exit codes:
  0  AGREE: every quantity within the rule
  1  DISAGREE: some quantity outside it (the report names the worst)
  2  refused: a bad flag, an impossible layout or data, or (--hf-config) a plan the ranks
     refused; one error: line

defaults that differ from python -m fastpar.train:
  --steps {DEFAULTS["steps"]}; with --hf-config also --batch-size {HF_DEFAULTS["batch_size"]} and --seq-len {HF_DEFAULTS["seq_len"]}, and
  check_parallel first (logits, loss and every gradient on every rank) when --pp is 1.
"""


def parser(hf: bool = False):
    """verify's parser: the trainer's flags with verify's help and defaults."""
    return build_parser(
        "python -m fastpar.verify",
        description=HELP,
        epilog=EPILOG,
        defaults=HF_DEFAULTS if hf else DEFAULTS,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # a flag only a training run takes (the checkpoint group's: --resume, --save-every, ...)
    flags = {flag(spec.name) for spec in flag_specs() if spec.option.group == CHECKPOINTS}
    only = next((a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in flags), None)
    if only is not None:
        return refuse(
            ValueError(
                f"{only} is a flag of python -m fastpar.train only: fastpar.verify trains both "
                f"runs from scratch in a temporary directory and keeps no checkpoint; drop {only}"
            )
        )
    if any(a == "--hf-config" or a.startswith("--hf-config=") for a in argv):
        return _main_hf(argv)
    ap = parser()
    try:  # the training command's checks: flags, devices, data (every id), memory
        cfg, tokens = prepare(ap.parse_args(argv))
        check_precision(cfg)
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    ok, text = compare(cfg, tokens)
    print(text)
    return 0 if ok else 1


def _main_hf(argv: list[str]) -> int:
    """--hf-config: a Hugging Face model, proven twice. First ``check_parallel`` (tp x dp, the
    ZeRO stage): logits, loss and every gradient on every rank on one batch, then the
    parameters after AdamW steps. Then the training command itself (any of its flags, pp
    included) beside the single-process model, as for the GPT. Exit 0 only if both agree."""
    ap = parser(hf=True)
    try:
        cfg, tokens = prepare(ap.parse_args(argv))
        check_precision(cfg)
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    ok = True
    if cfg.pp == 1:
        flags = ["--hf-config", cfg.hf_config, "--tp", str(cfg.tp), "--dp", str(cfg.dp)]
        flags += ["--zero", str(cfg.zero), "--steps", str(cfg.steps), "--seed", str(cfg.seed)]
        code = parity.main(flags)
        if code == 2:
            return 2
        ok &= code == 0
    else:
        print("check_parallel: skipped at pp > 1 (it runs tp x dp); the trainer run below has pp")
    print()
    try:
        agree, text = compare(cfg, tokens)
    except RankError as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print("training command:", text, sep="\n")
    return 0 if ok and agree else 1


if __name__ == "__main__":
    sys.exit(main())
