"""A run's numbers, read on the steps that need them (``resolve``: one host sync): the losses,
gradient norms and skipped flags, the memory, the progress line, tokens per second, FLOPs per
token and MFU (docs/metrics.md), and the row of a logged step (``MetricsWriter``: a JSON line and
TensorBoard scalars)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import threading
import time

import torch
import torch.distributed as dist

from fastpar.amp.norm import counts_on_this_rank
from fastpar.cliutil import os_error_text
from fastpar.comm import plain
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import is_expert
from fastpar.models import native
from fastpar.train.stragglers import straggler_text

#: dense (no sparsity) bf16 tensor-core peak FLOP/s by device name, for MFU; the first key that
#: is part of torch.cuda.get_device_name() wins (so "H100 PCIe" before "H100")
PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
}
TENSORBOARD_HINT = "pip install fastpar[tensorboard]"


def _dp_sum(values: list, mesh: ParallelMesh, device: torch.device) -> torch.Tensor:
    """``values`` (scalar tensors; None: 0) of the last pipeline stage, summed over dp x cp: one
    broadcast over the pipeline group, one all-reduce."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    out = torch.stack([zero if v is None else v for v in values])
    if mesh.pp_size > 1:
        plain.broadcast(out, src=mesh.ranks("pp")[-1], group=mesh.pp_group)
    plain.all_reduce(out, group=mesh.dp_cp_group)  # cp ranks: each its chunks' mean
    return out


def resolve(records: list[dict], mesh: ParallelMesh, device: torch.device) -> None:
    """Turn the device tensors of ``records`` (``Trainer.step``'s, of the steps since the last
    call) into numbers, alike on every rank: ``loss`` averaged over data parallelism (``_dp_sum``),
    ``grad_norm`` (global already) and ``skipped``; one host sync, whatever the number of
    records. --mtp-depth: ``mtp_loss`` averaged as ``loss`` is (a skipped empty step's: 0)."""
    if not records:
        return
    losses = _dp_sum([r["loss"] for r in records], mesh, device)
    norms = torch.stack([r["grad_norm"].reshape(()).float() for r in records])
    skipped = torch.stack([r["skipped"].reshape(()).float() for r in records])
    values = torch.cat([losses, norms.to(device), skipped.to(device)]).tolist()
    k, ranks = len(records), mesh.dp_size * mesh.cp_size
    for i, r in enumerate(records):
        r["loss"] = values[i] / ranks
        r["grad_norm"] = values[k + i]
        r["skipped"] = values[2 * k + i] > 0
    if any("mtp_loss" in r for r in records):
        mtp = _dp_sum([r.get("mtp_loss") for r in records], mesh, device).tolist()
        for r, value in zip(records, mtp, strict=True):
            r["mtp_loss"] = value / ranks


def param_counts(
    module: torch.nn.Module, mesh: ParallelMesh | None, device: torch.device
) -> dict[str, int]:
    """Parameters of the whole model, each counted once across the layout (one all-reduce):
    ``total``; ``embedding`` (of embedding tables); ``experts`` (of fastpar MoE layers' experts,
    the router and shared experts left out)."""
    from fastpar.moe import moe_layers
    from fastpar.nn import VocabParallelEmbedding

    tables = (torch.nn.Embedding, VocabParallelEmbedding)
    embedding = {id(p) for m in module.modules() if isinstance(m, tables) for p in m.parameters()}
    experts = {  # routed experts only: not the router, not shared experts
        id(p) for m in moe_layers(module) for p in m.parameters() if is_expert(p)
    }
    counts = [0.0, 0.0, 0.0]
    for p in module.parameters():
        if counts_on_this_rank(p, mesh=mesh):
            counts[0] += p.numel()
            counts[1] += p.numel() if id(p) in embedding else 0
            counts[2] += p.numel() if id(p) in experts else 0
    t = torch.tensor(counts, dtype=torch.float64, device=device)
    plain.all_reduce(t)
    total, emb, exp = (int(v) for v in t.tolist())
    return {"total": total, "embedding": emb, "experts": exp}


def model_shape(cfg) -> dict:
    """What the FLOPs count needs beyond the parameters: layers, heads, head width, hidden,
    whether the LM head is tied to the embedding; MoE's top_k / num_experts; the MTP modules
    (--mtp-depth)."""
    if cfg.hf_config:
        from fastpar.models.hf import load_config

        c = load_config(cfg.hf_config)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return dict(
            layers=c.num_hidden_layers,
            heads=heads,
            head_dim=head_dim,
            hidden=c.hidden_size,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            expert_share=1.0,
            mtp_depth=0,
        )
    width = native.get(cfg.model_type).head_dim  # (DeepSeek: q/k's and v's widths averaged)
    head_dim = width(cfg.model) if width is not None else None
    return dict(
        layers=cfg.model.layers,
        heads=cfg.model.heads,
        head_dim=head_dim or cfg.model.hidden // cfg.model.heads,
        hidden=cfg.model.hidden,
        tied=cfg.model.tie_embeddings,
        expert_share=cfg.model.top_k / cfg.model.num_experts,
        mtp_depth=getattr(cfg.model, "mtp_depth", 0),
    )


def flops_per_token(cfg, counts: dict[str, int]) -> float:
    """Training FLOPs per token (forward + backward): 6 N + 12 L H Q S (docs/metrics.md says
    what N counts). With --mtp-depth D the MTP modules' parameters are in N like the layers'
    (their lookups in the shared embedding are not), each module's logits by the shared head
    add vocab x hidden to N, and its block is one more of the L layers."""
    shape = model_shape(cfg)
    n = counts["total"] - counts["embedding"] - counts["experts"] * (1 - shape["expert_share"])
    depth = shape["mtp_depth"]
    n += (int(shape["tied"]) + depth) * cfg.vocab * shape["hidden"]
    layers = shape["layers"] + depth
    attention = 12 * layers * shape["heads"] * shape["head_dim"] * cfg.model.seq_len
    return 6.0 * n + attention


def peak_flops(device: torch.device, peak_tflops: float | None = None) -> float | None:
    """One device's peak FLOP/s: ``peak_tflops`` (TFLOP/s) when given, else a known GPU's
    dense bf16 peak (``PEAK_FLOPS``), else None."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def mfu(
    tokens_per_s: float,
    params: int,
    device: torch.device,
    world: int,
    *,
    flops_per_token: float | None = None,
    peak_tflops: float | None = None,
) -> float | None:
    """Model FLOPs utilisation: ``flops_per_token`` (default 6 per parameter) x global
    ``tokens_per_s`` against ``world`` devices' peak (``peak_flops``); None when no peak is
    known (a CPU without ``peak_tflops``)."""
    peak = peak_flops(device, peak_tflops)
    per_token = 6.0 * params if flops_per_token is None else flops_per_token
    return None if peak is None else per_token * tokens_per_s / (peak * world)


def memory_mib(device: torch.device) -> float:
    """This rank's peak memory: the GPU's allocated bytes, else the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reserved_mib(device: torch.device, mesh: ParallelMesh | None = None) -> float | None:
    """The largest peak of memory reserved by torch's CUDA caching allocator over the ranks
    (one MAX all-reduce); None off CUDA."""
    if device.type != "cuda":
        return None
    t = torch.tensor([torch.cuda.max_memory_reserved(device) / 2**20], device=device)
    plain.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _memory_text(row: dict) -> str:
    if row["mem_kind"] == "cuda":
        return (
            f"mem {row['mem_mib']:.0f} MiB alloc / {row['mem_reserved_mib'] or 0:.0f} MiB "
            "reserved (peak/rank)"
        )
    return f"mem {row['mem_mib']:.0f} MiB RSS (peak/rank)"


def progress_line(cfg, row: dict) -> str:
    """Rank 0's line for a logged step (``row``: ``metrics_row``'s)."""
    step = row["step"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["time"]))
    norm = "nan" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"
    return (
        f"{stamp} {bar(step, cfg.steps)} step {step:>4}/{cfg.steps} | loss {_num(row['loss'])} "
        f"| lr {row['lr']:.2e} | grad-norm {norm} | {row['tokens_per_s']:,.0f} tok/s "
        f"({row['tokens_per_s_per_device']:,.0f}/device) | {_memory_text(row)}"
        + (f" | MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")
        + f" | elapsed {_clock(row['elapsed_s'])} | ETA {_clock(row['eta_s'])}"
        + (" | skipped" if row["skipped"] else "")
        + (f" | val_loss {_num(row['val_loss'])}" if "val_loss" in row else "")
        + (f" | mtp_loss {_num(row['mtp_loss'])}" if "mtp_loss" in row else "")
        + straggler_text(row)
    )


def _num(x: float | None) -> str:
    return "nan" if x is None else f"{x:.4f}"


def _finite(x: float) -> float | None:
    """JSON has no NaN / inf: a non-finite number is written as null."""
    return x if math.isfinite(x) else None


def metrics_row(
    cfg,
    pending: list[dict],
    *,
    seconds: float,
    elapsed: float,
    steps_run: int,
    flops: float,
    device: torch.device,
    mem: tuple[float, float | None],
    skipped_steps: int,
    compile_s: float = 0.0,
    compile_steps: int = 0,
) -> dict:
    """The numbers of a logged step (the last of ``pending``, the steps since the last sync
    point, resolved): what the progress line prints and the JSONL / TensorBoard record.
    ``seconds``: their wall time; ``elapsed``: since the run's first step, ``steps_run`` steps
    ago; ``flops``: FLOPs per token; ``mem``: (peak MiB per rank, CUDA reserved MiB or None);
    ``skipped_steps``: steps skipped since the last logged step, this one included;
    ``compile_s`` / ``compile_steps``: the time and steps of --compile's first step, left out
    of the ETA's rate (no rate yet: ETA None until a step after it)."""
    rec = pending[-1]
    tps = cfg.batch_size * cfg.model.seq_len * len(pending) / max(seconds, 1e-9)
    timed = steps_run - compile_steps
    per_step = (elapsed - compile_s) / timed if timed > 0 else None
    val = {"val_loss": _finite(rec["val_loss"])} if "val_loss" in rec else {}
    if "mtp_loss" in rec:  # --mtp-depth: loss = the main loss + mtp_loss_coef x mtp_loss
        val["mtp_loss"] = _finite(rec["mtp_loss"])
    return val | {
        "step": rec["step"],
        "steps": cfg.steps,
        "loss": _finite(rec["loss"]),
        "lr": rec["lr"],
        "grad_norm": _finite(rec["grad_norm"]),
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / cfg.world_size,
        "flops_per_token": flops,
        "mfu": mfu(
            tps, 0, device, cfg.world_size, flops_per_token=flops, peak_tflops=cfg.peak_tflops
        ),
        "mem_kind": "cuda" if device.type == "cuda" else "rss",  # what ``memory_mib`` measures
        "mem_mib": mem[0],
        "mem_reserved_mib": mem[1],
        "skipped": bool(rec["skipped"]),
        "skipped_steps": skipped_steps,
        "time": time.time(),
        "elapsed_s": elapsed,
        "eta_s": None if per_step is None else per_step * (cfg.steps - rec["step"]),
    }


def open_tensorboard(log_dir: str):
    """A ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            f"--tensorboard needs the tensorboard package ({exc}): {TENSORBOARD_HINT}"
        ) from exc
    return SummaryWriter(log_dir=log_dir)


#: the row's numbers TensorBoard plots, under "train/<name>"
SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "mfu",
    "mem_mib",
    "mem_reserved_mib",
    "skipped_steps",
    "val_loss",
    "mtp_loss",
)


class MetricsWriter:
    """Rank 0's records of logged steps: one JSON object a line in ``--metrics-file`` and
    scalars under ``--tensorboard DIR`` (a no-op when neither is set). A write that fails (a full
    disk) is one warning, never the run's end (docs/metrics.md, "The JSONL schema"); the
    TensorBoard writer thread's own traceback is not printed: the warning says it."""

    def __init__(self, cfg, resumed: bool) -> None:
        self.fd = self.tb = None
        self.cfg, self.warned = cfg, set()
        self.hook = None
        if cfg.metrics_file:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if resumed else os.O_TRUNC)
            try:
                os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_file)), exist_ok=True)
                self.fd = os.open(cfg.metrics_file, flags, 0o644)
            except OSError as e:
                self._failed("--metrics-file", cfg.metrics_file, e, "no row is written")
        if cfg.tensorboard:
            self.hook = threading.excepthook
            threading.excepthook = self._thread_error
            try:
                self.tb = open_tensorboard(cfg.tensorboard)
            except OSError as e:
                self._failed("--tensorboard", cfg.tensorboard, e, "no scalar is written")
            except BaseException:  # (no tensorboard package: the run's one-line refusal)
                threading.excepthook, self.hook = self.hook, None
                raise

    def _failed(self, flag: str, path: str, e: OSError, then: str) -> None:
        if flag not in self.warned:
            self.warned.add(flag)
            print(
                f"warning: {flag} {path}: {os_error_text(e)}; {then} (the run goes on)",
                file=sys.stderr,
                flush=True,
            )

    def _thread_error(self, args) -> None:
        if type(args.thread).__module__.startswith("tensorboard.") and issubclass(
            args.exc_type, OSError
        ):
            return  # its writer thread's: ``write`` warns
        (self.hook or threading.__excepthook__)(args)

    def write(self, row: dict) -> None:
        if self.fd is not None:
            data = memoryview((json.dumps(row, allow_nan=False) + "\n").encode())
            start = os.fstat(self.fd).st_size
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, start)
                then = f"the row of step {row['step']} is left out, as is any later one that fails"
                self._failed("--metrics-file", self.cfg.metrics_file, e, then)
        if self.tb is not None:
            try:
                for name in SCALARS:
                    if row.get(name) is not None:
                        self.tb.add_scalar(f"train/{name}", row[name], row["step"])
                self.tb.flush()
            except OSError as e:
                then = f"no scalars from step {row['step']} on"
                self._failed("--tensorboard", self.cfg.tensorboard, e, then)
                self._close_tb()

    def _close_tb(self) -> None:
        tb, self.tb = self.tb, None
        try:
            tb.close()
        except OSError as e:  # its last flush
            self._failed("--tensorboard", self.cfg.tensorboard, e, "its last scalars are lost")

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        if self.tb is not None:
            self._close_tb()
        if self.hook is not None and threading.excepthook == self._thread_error:
            threading.excepthook = self.hook
        self.fd = self.tb = self.hook = None
