"""``python -m fastpar.verify``: prove a layout equal to the single-process model.

    python -m fastpar.verify --tp 2 --pp 2 --dp 2 --ep 2 --zero 1 --steps 3
    python -m fastpar.verify --pp 2 --dp 2 --schedule interleaved --virtual-stages 2 --eval-every 2

    python -m fastpar.verify --model llama --kv-heads 2 --qk-norm --tp 2 --pp 2 --dp 2 --ep 2
    python -m fastpar.verify --hf-config config.json --tp 2 --dp 2 --zero 1   # your HF model

Trains the model of ``fastpar.train`` (``--model gpt`` or ``llama``) under the given layout (any
of its flags: precision, schedule, micro-batches, ZeRO stage, sequence parallelism, MoE
settings, data and tokenizer...) and the
single-process reference from the same initialisation on the same data, then prints both losses
per step (and both validation losses with --eval-every) and the largest parameter difference, and exits 0 only when they agree within the
tolerance of the precision (fp32 is tight; bf16 / fp16 are loose).

The reference is built by the trainer's own code (``fastpar.train.build.build`` without a mesh:
the same model, precision, optimizer groups, fused AdamW, clipping, loss scaler, loss and MoE
set-up), so it cannot drift from the trainer, and does exactly the distributed run's math on
one process: each data-parallel replica's micro-batches are run one by one (every micro-batch
loss and MoE auxiliary loss weighted 1 / micro-batches, gradients accumulating in the model's
dtype), the replicas' gradients are averaged in fp32, then one optimizer step and (with
--expert-bias) the expert-bias update from every replica's routed tokens. Final parameters (and
expert biases) of the distributed run come back through a fastpar checkpoint exported to a
plain state_dict, so resharding is checked too.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

import torch

from fastpar import checkpoint, parity
from fastpar.launch import RankError
from fastpar.train import (
    TrainConfig,
    batch_of,
    build_parser,
    launch,
    load_data,
    lr_at,
)
from fastpar.train.batches import eval_batch, split_tokens
from fastpar.train.build import build
from fastpar.train.cli import prepare, refuse
from fastpar.train.loop import evaluates_at

TOLERANCE = {  # (loss relative, parameter absolute)
    "fp32": (1e-4, 2e-4),
    "bf16": (3e-2, 3e-2),
    "fp16": (1e-2, 1e-2),
}


def _val_loss(cfg: TrainConfig, parts, held) -> float:
    """The validation loss on one process: every held-out batch, replica by replica and
    micro-batch by micro-batch (the distributed run's averaging), the model in eval mode."""
    model, total = parts.module, 0.0
    model.eval()
    with torch.no_grad():
        for j in range(cfg.eval_batches):
            x, y = eval_batch(cfg, held, j, parts.hf)
            for xd, yd in zip(x.chunk(cfg.dp), y.chunk(cfg.dp), strict=True):
                for xc, yc in zip(
                    xd.chunk(cfg.microbatches), yd.chunk(cfg.microbatches), strict=True
                ):
                    loss = parts.loss_fn(model(xc), yc).float()
                    total += float(loss) / (cfg.microbatches * cfg.dp * cfg.eval_batches)
    model.train()
    return total


def reference(
    cfg: TrainConfig, tokens=None, val_losses: dict | None = None, norms: list | None = None
):
    """Single-process training with the distributed run's math. Returns (losses, params).
    The model, its precision, the optimizer (groups, clipping, loss scaler), the loss and the
    MoE auxiliary-loss scale are the trainer's own (``fastpar.train.build.build`` without a
    mesh); only the step is written here, replica by replica. Training reads the trainer's
    split of the data (``split_tokens``); with --eval-every, ``val_losses`` (a dict) receives
    {step: validation loss} at the trainer's evaluation steps; ``norms`` (a list) each step's
    gradient norm before clipping. ``params`` holds what a checkpoint of the trainer holds:
    the parameters and, with --expert-bias, every router's ``expert_bias`` (updated after each
    step from the tokens of every replica, as the trainer's all-reduce over DP sums them)."""
    parts = build(cfg, None, torch.device("cpu"))
    model, opt = parts.module, parts.opt
    tokens = load_data(cfg) if tokens is None else tokens
    tokens, held = split_tokens(cfg, tokens)
    params = list(model.parameters())
    losses = []
    for step in range(cfg.steps):
        for g in parts.param_groups:
            g["lr"] = lr_at(cfg, step)
        parts.update_aux_scale()
        x, y = batch_of(cfg, tokens, step, parts.hf)
        total, acc = 0.0, [torch.zeros_like(p, dtype=torch.float32) for p in params]
        # replica by replica, as the data-parallel ranks do: micro-batch gradients accumulate in
        # the model's dtype, replicas are averaged in fp32 (the DP reduction)
        for xd, yd in zip(x.chunk(cfg.dp), y.chunk(cfg.dp), strict=True):
            opt.zero_grad()
            for xc, yc in zip(xd.chunk(cfg.microbatches), yd.chunk(cfg.microbatches), strict=True):
                loss = parts.loss_fn(model(xc), yc) / cfg.microbatches
                opt.scale_loss(loss).backward()
                total += float(loss.detach()) / cfg.dp
            for a, p in zip(acc, params, strict=True):
                if p.grad is not None:
                    a.add_(p.grad.float(), alpha=1.0 / cfg.dp)
        for a, p in zip(acc, params, strict=True):
            p.grad = a.to(p.dtype)
        skipped, norm = opt.step()
        parts.update_expert_bias(skipped, None)  # the trainer's bias step (counts: every replica)
        opt.zero_grad()
        losses.append(total)
        if norms is not None:
            norms.append(float(norm))
        if val_losses is not None and evaluates_at(cfg, step + 1):
            val_losses[step + 1] = _val_loss(cfg, parts, held)
    named = parts.checkpoint_tensors()  # parameters, and the routers' expert biases
    params = {name: p.detach().float().clone() for name, p in named.items()}
    return losses, params


def _distributed(
    cfg: TrainConfig, directory: str, tokens
) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg.checkpoint_dir, cfg.save_every, cfg.quiet = directory, cfg.steps, True
    records = launch(cfg, tokens=tokens)
    path = os.path.join(directory, f"step_{cfg.steps:06d}")
    out_file = os.path.join(directory, "export.pt")
    checkpoint.export_state_dict(path, out_file)
    state = torch.load(out_file, weights_only=True)
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    losses = [(r["loss"], r["grad_norm"]) for r in records]
    return losses, {k: v.float() for k, v in state.items()}, vals


def compare(cfg: TrainConfig, tokens=None) -> tuple[bool, str]:
    """Run both, return (agree, the report text). ``tokens``: the data, already checked
    (``fastpar.train.load_data``; None: load and check them here)."""
    loss_tol, param_tol = TOLERANCE[cfg.precision]
    cfg.check()
    tokens = load_data(cfg) if tokens is None else tokens
    with tempfile.TemporaryDirectory(prefix="fastpar-verify-") as directory:
        dist_losses, dist_params, dist_vals = _distributed(cfg, directory, tokens)
    ref_vals: dict[int, float] = {}
    ref_norms: list[float] = []
    ref_losses, ref_params = reference(cfg, tokens, ref_vals, ref_norms)
    lines = [
        f"{cfg.model_name}, layout: dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp}"
        f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} (ep {cfg.ep}), ZeRO-{cfg.zero}, {cfg.precision}, "
        f"{cfg.schedule_label} x {cfg.microbatches}{f', recompute {cfg.recompute_policy}' if cfg.recompute else ''}"
        f"{', sequence parallel' if cfg.sequence_parallel else ''}",
        f"{'step':>5} {'distributed':>14} {'single-process':>15} {'rel. diff':>10}"
        f" {'grad-norm dist.':>15} {'single':>10}",
    ]
    ok = len(dist_losses) == len(ref_losses)
    for i, ((a, na), b, nb) in enumerate(zip(dist_losses, ref_losses, ref_norms, strict=False)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        ok &= rel <= loss_tol
        # the norm before clipping: a gradient reduced twice or lost moves it (AdamW would not)
        # (a step both skipped for inf/NaN gradients: both norms non-finite, NaN included)
        skipped = not math.isfinite(na) and not math.isfinite(nb)
        ok &= skipped or na == nb or abs(na - nb) <= loss_tol * max(abs(nb), 1e-12)
        lines.append(f"{i + 1:>5} {a:>14.6f} {b:>15.6f} {rel:>10.2e} {na:>15.6f} {nb:>10.6f}")
    if ref_vals or dist_vals:
        ok &= sorted(ref_vals) == sorted(dist_vals)
        lines.append(f"{'step':>5} {'val_loss dist.':>14} {'single-process':>15} {'rel. diff':>10}")
        for step, b in ref_vals.items():
            a = dist_vals.get(step, float("nan"))
            rel = abs(a - b) / max(abs(b), 1e-12)
            ok &= rel <= loss_tol
            lines.append(f"{step:>5} {a:>14.6f} {b:>15.6f} {rel:>10.2e}")
    missing = sorted(set(ref_params) - set(dist_params))
    if missing:
        ok = False
        lines.append(f"parameters missing from the distributed checkpoint: {missing[:5]}")
    worst, worst_name = 0.0, ""
    for name, ref in ref_params.items():
        got = dist_params.get(name)
        if got is None:
            continue
        if got.shape != ref.shape:
            ok = False
            lines.append(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
            continue
        d = (got - ref).abs().max().item() if ref.numel() else 0.0
        if d > worst:
            worst, worst_name = d, name
    ok &= worst <= param_tol
    lines.append(
        f"largest parameter difference: {worst:.3e} ({worst_name or '-'}), tolerance {param_tol:.0e}"
    )
    lines.append(f"loss tolerance (relative): {loss_tol:.0e}")
    lines.append("AGREE" if ok else "DISAGREE")
    return ok, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--hf-config" or a.startswith("--hf-config=") for a in argv):
        return _main_hf(argv)
    ap = build_parser("python -m fastpar.verify")
    ap.set_defaults(steps=3)
    try:  # the training command's checks: flags, devices, data (every id), memory
        cfg, tokens = prepare(ap.parse_args(argv))
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
    ap = build_parser("python -m fastpar.verify")
    ap.set_defaults(steps=3, batch_size=8, seq_len=16)
    try:
        cfg, tokens = prepare(ap.parse_args(argv))
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
