"""``python -m fastpar.train``: train a small GPT with DP x TP x PP x EP, ZeRO and mixed precision.

    python -m fastpar.train                                   # defaults: 8 CPU ranks, every parallelism
    python -m fastpar.train --tp 2 --pp 2 --dp 2 --zero 1 --precision bf16 --steps 100
    torchrun --nproc-per-node 8 -m fastpar.train --tp 2 --pp 2 --ep 2   # under torchrun: its ranks

Without torchrun it starts the ranks itself on this machine (tp·pp·dp of them; gloo on CPUs,
NCCL on GPUs). Data: ``--data`` (a text file, tokenised at byte level, or a ``.npy`` array of
token ids), else an embedded corpus: text that ships with Python itself. Every step is
deterministic given the seed: the same batch at the same step on any layout, which is what
``python -m fastpar.verify`` relies on.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist

from fastpar.mesh import MeshLayout, ParallelMesh
from fastpar.models.gpt import GPTConfig, build_gpt, gpt_loss, untie_for_pipeline
from fastpar.moe import MoE
from fastpar.parallel.pipeline import (
    GPipe,
    OneFOneB,
    PipelineEngine,
    build_stage,
    tie_across_stages,
)
from fastpar.profiling import nvtx

#: every collective fails after this long instead of hanging (a dead or stuck peer)
COLLECTIVE_TIMEOUT_S = float(os.environ.get("FASTPAR_COLLECTIVE_TIMEOUT", "300"))


@dataclass
class TrainConfig:
    """Everything a run needs (the CLI's flags)."""

    tp: int = 2
    pp: int = 2
    dp: int = 2
    ep: int = 2
    zero: int = 1
    precision: str = "fp32"
    microbatches: int = 2
    schedule: str = "1f1b"
    recompute: bool = False
    steps: int = 30
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 5
    lr_schedule: str = "cosine"
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    loss_scale: float = 4096.0
    seed: int = 1234
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    moe_every: int = 2
    experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None
    overlap_chunks: int = 1
    sequence_parallel: bool = False
    untied: bool = False
    norm: str = "rmsnorm"
    data: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    profile: str | None = None
    log_every: int = 1
    quiet: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def model(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=256, seq_len=self.seq_len, hidden=self.hidden, heads=self.heads,
            layers=self.layers, moe_every=self.moe_every, num_experts=self.experts,
            top_k=self.top_k, capacity_factor=self.capacity_factor,
            overlap_chunks=self.overlap_chunks, norm=self.norm,
            tie_embeddings=not self.untied, sequence_parallel=self.sequence_parallel,
        )  # fmt: skip

    def check(self) -> None:
        """Refuse an impossible run before any process group exists."""
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule must be gpipe or 1f1b, got {self.schedule!r}")
        if min(self.tp, self.pp, self.dp, self.ep, self.microbatches, self.steps) < 1:
            raise ValueError("tp, pp, dp, ep, microbatches and steps must all be >= 1")
        MeshLayout(self.world_size, tp=self.tp, pp=self.pp, ep=self.ep)
        per_rank = self.batch_size // self.dp
        if self.batch_size % self.dp or per_rank % self.microbatches:
            raise ValueError(
                f"batch_size {self.batch_size} must split into dp={self.dp} replicas of "
                f"{self.microbatches} micro-batches each (a multiple of {self.dp * self.microbatches})"
            )
        if self.zero == 3 and self.pp > 1:
            raise ValueError("zero=3 with pp > 1 is not supported: use zero <= 2 with pipelines")
        self.model().check(self.tp, self.pp, self.ep)


# -- data --------------------------------------------------------------------------------------
def embedded_corpus() -> bytes:
    """Text that ships with every Python: the Zen of Python and the sources (with their
    docstrings) of a few standard-library modules."""
    import argparse as m1
    import ast
    import codecs
    import importlib.util
    import string as m2
    import textwrap as m3

    # `import this` would print the Zen; read its (rot13) text from the module's source instead
    with open(importlib.util.find_spec("this").origin) as f:
        tree = ast.parse(f.read())
    rot13 = next(
        n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "s"
    )
    zen = codecs.decode(rot13, "rot_13")
    return (zen + "\n" + "\n".join(inspect.getsource(m) for m in (m3, m2, m1))).encode()


def load_tokens(path: str | None) -> torch.Tensor:
    """1-D int64 token ids: bytes of a text file, a .npy array, or the embedded corpus."""
    if path is None:
        data = embedded_corpus()
    elif path.endswith(".npy"):
        import numpy as np

        return torch.from_numpy(np.load(path).astype("int64"))
    else:
        with open(path, "rb") as f:
            data = f.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def global_batch(tokens: torch.Tensor, step: int, batch: int, seq: int, seed: int):
    """The mini-batch of ``step``: [batch, seq] inputs and next-token targets, the same on
    every rank and every layout."""
    if tokens.numel() < seq + 2:
        raise ValueError(
            f"the corpus has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq + 2}"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq + 1)
    rows = tokens[idx]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


# -- one rank ----------------------------------------------------------------------------------
class Trainer:
    """Builds this rank's stage, optimizer and pipeline engine; runs steps."""

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh, device: torch.device):
        from fastpar.amp import DynamicLossScaler
        from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
        from fastpar.parallel import DistributedDataParallel
        from fastpar.zero import Zero3, ZeroOptimizer

        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.model_cfg = cfg.model()
        torch.manual_seed(cfg.seed)
        blocks = build_gpt(self.model_cfg, mesh)
        tied = untie_for_pipeline(blocks, mesh)
        stage, (self.start, _) = build_stage(
            blocks, mesh.pp_size, mesh.pp_rank, costs=[1.0] * len(blocks)
        )
        del blocks
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            cfg.precision
        ]
        stage = stage.to(device=device, dtype=dtype)
        if tied is not None:  # Module.to converts parameters in place: `tied` is still ours
            tie_across_stages(tied, mesh)
        self.stage_module = stage
        self.moes = [m for m in stage.modules() if isinstance(m, MoE)]
        scaler = (
            DynamicLossScaler(initial_scale=cfg.loss_scale, device=device)
            if cfg.precision == "fp16"
            else None
        )
        decay = [p for p in stage.parameters() if p.dim() >= 2]
        no_decay = [p for p in stage.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        no_sync = None
        if cfg.zero == 0:
            model = DistributedDataParallel(stage, mesh=mesh, reduce_dtype=torch.float32)
            opt = MixedPrecisionOptimizer(
                FusedAdamW(groups, lr=cfg.lr),
                scaler=scaler,
                max_grad_norm=cfg.max_grad_norm,
                mesh=mesh,
            )
            no_sync = model.no_sync
        elif cfg.zero in (1, 2):
            model = stage
            opt = ZeroOptimizer(
                FusedAdamW(groups, lr=cfg.lr), stage=cfg.zero, mesh=mesh, scaler=scaler,
                max_grad_norm=cfg.max_grad_norm,
            )  # fmt: skip
            no_sync = opt.no_sync
        else:
            from fastpar.models.gpt import Block

            model = opt = Zero3(
                stage, lambda gs: FusedAdamW(gs, lr=cfg.lr), mesh=mesh, param_groups=groups,
                wrap=(Block,), scaler=scaler, max_grad_norm=cfg.max_grad_norm,
            )  # fmt: skip
        self.model, self.opt, self.scaler = model, opt, scaler
        sched = (GPipe if cfg.schedule == "gpipe" else OneFOneB)(cfg.microbatches)
        self.engine = PipelineEngine(
            model,
            mesh,
            sched,
            loss_fn=lambda logits, y: gpt_loss(logits.float(), y, self.model_cfg, mesh),
            recompute=cfg.recompute,
            no_sync=no_sync,
            scale_loss=opt.scale_loss,
        )  # fmt: skip  (DDP / ZeRO sum the tied embedding's gradients themselves)
        self.tokens = load_tokens(cfg.data)
        self.step_count = 0

    @property
    def param_groups(self):
        opt = self.opt
        return opt.optimizer.param_groups if hasattr(opt, "optimizer") else opt.param_groups

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters under the single-process model's names."""
        from fastpar.checkpoint import stage_param_names

        return stage_param_names(self.stage_module, self.start)

    def step(self) -> dict:
        cfg, mesh = self.cfg, self.mesh
        lr = lr_at(cfg, self.step_count)
        for g in self.param_groups:
            g["lr"] = lr
        scale = self.scaler.scale if self.scaler is not None else 1.0
        for m in self.moes:  # aux losses enter backward like the main loss of a micro-batch
            m.aux_loss_scale = scale / cfg.microbatches
        x, y = global_batch(self.tokens, self.step_count, cfg.batch_size, cfg.seq_len, cfg.seed)
        per = cfg.batch_size // mesh.dp_size
        rows = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
        x, y = x[rows].to(self.device), y[rows].to(self.device)
        t0 = time.perf_counter()
        loss = self.engine.train_step(
            x if mesh.is_first_stage else None, y if mesh.is_last_stage else None
        )
        with nvtx("optimizer step"):
            skipped, norm = self.opt.step()
        self.opt.zero_grad()
        loss = loss.detach().float().clone()
        dist.all_reduce(loss, group=mesh.dp_group)
        self.step_count += 1
        return {
            "step": self.step_count, "loss": float(loss) / mesh.dp_size, "lr": lr,
            "grad_norm": float(norm), "skipped": bool(skipped), "seconds": time.perf_counter() - t0,
        }  # fmt: skip


#: dense bf16 tensor-core peak FLOP/s by device name (for MFU)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def _global_param_count(trainer: Trainer) -> int:
    """Parameters of the whole model, each counted once across the layout (one all-reduce)."""
    from fastpar.amp.norm import counts_on_this_rank

    mesh = trainer.mesh
    n = sum(
        p.numel() for p in trainer.stage_module.parameters() if counts_on_this_rank(p, mesh=mesh)
    )
    t = torch.tensor(float(n), device=trainer.device)
    dist.all_reduce(t)
    return int(t.item())


def _mfu(tokens_per_s: float, params: int, device: torch.device, world: int) -> float | None:
    """Model FLOPs utilisation: 6 FLOPs per parameter per token (forward + backward) against the
    GPUs' peak; None off CUDA or on a device not in PEAK_FLOPS."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else 6 * params * tokens_per_s / (peak * world)


def _memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def run(cfg: TrainConfig) -> list[dict]:
    """Train on this rank (the default process group must exist). Returns the step records."""
    mesh = ParallelMesh(cfg.tp, cfg.pp, cfg.ep)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    trainer = Trainer(cfg, mesh, device)
    talk = dist.get_rank() == 0 and not cfg.quiet
    start = 0
    if cfg.resume and cfg.checkpoint_dir:
        start = _resume(trainer, cfg.checkpoint_dir, talk)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    total_params = _global_param_count(trainer)
    if talk:
        n = sum(p.numel() for p in trainer.stage_module.parameters())
        print(
            f"fastpar.train: world {cfg.world_size} = dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} "
            f"(ep {cfg.ep}), ZeRO-{cfg.zero}, {cfg.precision}, {cfg.schedule} x {cfg.microbatches} "
            f"micro-batches, {dist.get_backend()}; {total_params:,} parameters, rank 0 holds {n:,}",
            flush=True,
        )
    prof = _profiler(cfg, device) if cfg.profile else contextlib.nullcontext()
    records = []
    with prof as p:
        for _ in range(start, cfg.steps):
            rec = trainer.step()
            records.append(rec)
            if p is not None:
                p.step()
            log_step = rec["step"] % cfg.log_every == 0 or rec["step"] == cfg.steps
            if log_step:  # the same on every rank: one small MAX all-reduce per logged step
                mem = torch.tensor(_memory_mib(device), device=device)  # NCCL needs it on the GPU
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
                rec["max_mem_mib"] = float(mem)
            if talk and log_step:
                tps = tokens_per_step / rec["seconds"]
                mfu = _mfu(tps, total_params, device, cfg.world_size)
                line = (
                    f"{_bar(rec['step'], cfg.steps)} step {rec['step']:>4}/{cfg.steps} | loss {rec['loss']:.4f} "
                    f"| lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | {tps:,.0f} tok/s "
                    f"| mem {rec['max_mem_mib']:.0f} MiB/rank"
                    + (f" | MFU {mfu:.1%}" if mfu is not None else "")
                    + (" | skipped" if rec["skipped"] else "")
                )
                print(line, flush=True)
            if cfg.checkpoint_dir and cfg.save_every and rec["step"] % cfg.save_every == 0:
                _save(trainer, cfg.checkpoint_dir, rec["step"], talk)
    if cfg.profile:
        os.makedirs(cfg.profile, exist_ok=True)
        path = os.path.join(cfg.profile, f"trace_rank{dist.get_rank()}.json")
        p.export_chrome_trace(path)
        if talk:
            print(f"profile: Chrome/Perfetto traces in {cfg.profile}/trace_rank*.json", flush=True)
    return records


def _profiler(cfg: TrainConfig, device: torch.device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, record_shapes=False)


def _save(trainer: Trainer, root: str, step: int, talk: bool) -> None:
    from fastpar import checkpoint

    path = os.path.join(root, f"step_{step:06d}")
    ctx = trainer.model.summon_full_params() if trainer.cfg.zero == 3 else contextlib.nullcontext()
    with ctx:
        checkpoint.save(
            path, model_params=trainer.named_parameters(), optimizer=trainer.opt, mesh=trainer.mesh,
            step=step, extra={"step": step}, overwrite=True,
        )  # fmt: skip
    if talk:
        print(f"checkpoint: {path}", flush=True)


def latest_checkpoint(root: str) -> str | None:
    from fastpar import checkpoint

    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root), reverse=True):
        path = os.path.join(root, name)
        if name.startswith("step_") and not name.endswith(".partial"):
            try:
                checkpoint.verify(path)
                return path
            except Exception:
                continue
    return None


def _resume(trainer: Trainer, root: str, talk: bool) -> int:
    from fastpar import checkpoint

    path = latest_checkpoint(root)
    if path is None:
        if talk:
            print(f"resume: no complete checkpoint in {root}; starting from step 0", flush=True)
        return 0
    ctx = trainer.model.summon_full_params() if trainer.cfg.zero == 3 else contextlib.nullcontext()
    with ctx:
        info = checkpoint.load(
            path, model_params=trainer.named_parameters(), optimizer=trainer.opt, mesh=trainer.mesh
        )
    trainer.step_count = int(info["step"])
    if talk:
        print(f"resume: {path} (step {trainer.step_count})", flush=True)
    return trainer.step_count


# -- launching ---------------------------------------------------------------------------------
def _rank_main(cfg: TrainConfig) -> list[dict]:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return run(cfg)


def launch(cfg: TrainConfig, timeout: float = 24 * 3600.0) -> list[dict]:
    """Run ``cfg`` on this machine: under torchrun on its ranks, else on ranks started here.
    Returns rank 0's step records."""
    cfg.check()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from fastpar.mesh import init

        if int(os.environ["WORLD_SIZE"]) != cfg.world_size:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but tp*pp*dp = {cfg.tp}*{cfg.pp}*"
                f"{cfg.dp} = {cfg.world_size}; pass --dp {int(os.environ['WORLD_SIZE']) // (cfg.tp * cfg.pp)}"
            )
        from datetime import timedelta

        init(cfg.tp, cfg.pp, cfg.ep, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return _rank_main(cfg)
    from fastpar.testing import run_ranks

    if torch.cuda.is_available():
        if torch.cuda.device_count() < cfg.world_size:
            raise ValueError(
                f"{cfg.world_size} ranks need {cfg.world_size} GPUs, {torch.cuda.device_count()} visible"
            )
        out = run_ranks(
            _rank_main, cfg.world_size, cfg, backend="nccl", start_method="spawn", timeout=timeout
        )
    else:
        out = run_ranks(_rank_main, cfg.world_size, cfg, timeout=timeout)
    return out[0]


def build_parser(prog: str = "python -m fastpar.train") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            ap.add_argument(flag, action="store_true", help=f"(default {value})")
        elif f.name == "capacity_factor":
            ap.add_argument(
                flag, type=float, default=None, help="MoE capacity factor (default: dropless)"
            )
        elif f.name in ("data", "checkpoint_dir", "profile"):
            ap.add_argument(flag, type=str, default=None)
        else:
            ap.add_argument(flag, type=type(value), default=value, help=f"(default {value})")
    return ap


def config_from(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from(args)
    try:
        cfg.check()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = launch(cfg)
    if records and not cfg.quiet and "RANK" not in os.environ:
        first, last = records[0]["loss"], records[-1]["loss"]
        print(
            f"done: loss {first:.4f} -> {last:.4f} over {len(records)} steps; config {asdict(cfg)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
