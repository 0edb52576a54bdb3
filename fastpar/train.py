"""``python -m fastpar.train``: train a GPT or a Llama with DP x TP x PP x EP, ZeRO and mixed precision.

    python -m fastpar.train                                   # defaults: 8 CPU ranks, every parallelism
    python -m fastpar.train --tp 2 --pp 2 --dp 2 --zero 1 --precision bf16 --steps 100
    python -m fastpar.train --model llama --kv-heads 2 --qk-norm --tokenizer tok.json --data my.txt
    torchrun --nproc-per-node 8 -m fastpar.train --tp 2 --pp 2 --ep 2   # under torchrun: its ranks

Without torchrun it starts the ranks itself on this machine (tp·pp·dp of them; gloo on CPUs,
NCCL on GPUs). Models: ``--model gpt`` (default) or ``llama`` (``fastpar.models.llama``: GQA,
RoPE, SwiGLU, optional Qwen3 q/k-norm and Qwen2 q/k/v bias). Data (``fastpar.data``):
``--data`` a text file (its bytes, or its ids under ``--tokenizer tokenizer.json``, which also
sets the vocabulary size), a ``.npy`` array or a memory-mapped ``.bin`` file of token ids
(``--data-dtype`` uint16 / uint32); else an embedded corpus: text that ships with Python itself.
Every token id is checked against the vocabulary before any rank starts. Every step is
deterministic given the seed: the same batch at the same step on any layout, which is what
``python -m fastpar.verify`` relies on.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist

from fastpar.data import (
    BIN_DTYPES,
    check_token_ids,
    global_batch,
    load_tokens,
    tokenizer_vocab_size,
)
from fastpar.mesh import MeshLayout, ParallelMesh
from fastpar.models import GPTConfig, LlamaConfig, build_model, lm_loss, untie_for_pipeline
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

    model_type: str = "gpt"
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
    vocab_size: int | None = None
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    ffn: int | None = None
    moe_ffn: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    qk_norm: bool = False
    attention_bias: bool = False
    moe_every: int = 2
    experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None
    overlap_chunks: int = 1
    sequence_parallel: bool = False
    untied: bool = False
    norm: str = "rmsnorm"
    data: str | None = None
    data_dtype: str = "uint16"
    tokenizer: str | None = None
    hf_config: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    profile: str | None = None
    log_every: int = 1
    quiet: bool = False

    @property
    def model_name(self) -> str:
        """What trains: "gpt", "llama", or "hf:<config path>"."""
        return f"hf:{self.hf_config}" if self.hf_config else self.model_type

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def vocab(self) -> int:
        """--vocab-size, else the --hf-config model's, else the tokenizer's, else 256 (bytes)."""
        if self.vocab_size is not None:
            return self.vocab_size
        if self.hf_config:
            from fastpar.models.hf import read_config_json

            return int(read_config_json(self.hf_config)["vocab_size"])
        return tokenizer_vocab_size(self.tokenizer) if self.tokenizer else 256

    def model(self) -> GPTConfig | LlamaConfig:
        shared = dict(
            vocab_size=self.vocab, seq_len=self.seq_len, hidden=self.hidden, heads=self.heads,
            layers=self.layers, ffn=self.ffn, moe_every=self.moe_every, num_experts=self.experts,
            top_k=self.top_k, capacity_factor=self.capacity_factor,
            overlap_chunks=self.overlap_chunks, tie_embeddings=not self.untied,
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip
        if self.model_type == "llama":
            return LlamaConfig(
                kv_heads=self.kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
                moe_ffn=self.moe_ffn,
                qk_norm=self.qk_norm, attention_bias=self.attention_bias, **shared,
            )  # fmt: skip
        return GPTConfig(norm=self.norm, **shared)

    def _check_model_flags(self) -> None:
        if self.model_type not in ("gpt", "llama"):
            raise ValueError(f"model must be gpt or llama, got {self.model_type!r}")
        defaults = TrainConfig()
        if self.hf_config:
            self._check_hf(defaults)
        elif self.model_type == "gpt":
            llama_only = (
                "kv_heads",
                "head_dim",
                "rope_theta",
                "qk_norm",
                "attention_bias",
                "moe_ffn",
            )
            for name in llama_only:
                if getattr(self, name) != getattr(defaults, name):
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"{flag} is a Llama option: add --model llama")
        elif self.norm != "rmsnorm":
            raise ValueError(f"--norm {self.norm} is a GPT option: the Llama uses RMSNorm")
        if self.data_dtype not in BIN_DTYPES:
            raise ValueError(
                f"data_dtype must be one of {sorted(BIN_DTYPES)} (the ids of a .bin file), "
                f"got {self.data_dtype!r}"
            )
        if self.tokenizer and self.vocab_size is not None:
            n = tokenizer_vocab_size(self.tokenizer)
            if self.vocab_size < n:
                raise ValueError(
                    f"--vocab-size {self.vocab_size} is smaller than the {n} tokens of "
                    f"{self.tokenizer}: drop --vocab-size (it follows the tokenizer) or pass "
                    f">= {n}"
                )

    def _check_hf(self, defaults: TrainConfig) -> None:
        """--hf-config: the model is the config's; fastpar-model flags do not apply."""
        from fastpar.models.hf import DECODERS, is_masked_lm, load_config

        own = (
            "model_type",
            "kv_heads",
            "head_dim",
            "qk_norm",
            "attention_bias",
            "ffn",
            "moe_ffn",
            "untied",
        )
        for name in own:
            if getattr(self, name) != getattr(defaults, name):
                flag = "--model" if name == "model_type" else "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} does not apply with --hf-config (the config sets the model)"
                )
        if self.ep > 1:
            raise ValueError(
                f"--ep {self.ep} with --hf-config: a Hugging Face MoE block stays replicated over "
                "TP and is not expert-parallel here; use --ep 1"
            )
        if self.sequence_parallel:
            raise ValueError("--sequence-parallel is not supported with --hf-config")
        config = load_config(self.hf_config)
        if self.vocab_size is not None and self.vocab_size != config.vocab_size:
            raise ValueError(
                f"--vocab-size {self.vocab_size} differs from the config's vocab_size "
                f"{config.vocab_size}: drop --vocab-size"
            )
        if self.tokenizer and tokenizer_vocab_size(self.tokenizer) > config.vocab_size:
            raise ValueError(
                f"{self.tokenizer} has {tokenizer_vocab_size(self.tokenizer)} tokens, more than "
                f"the config's vocab_size {config.vocab_size}: use a matching tokenizer"
            )
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        if isinstance(limit, int) and self.seq_len > limit:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the config's {limit} positions")
        for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
            heads = getattr(config, key, None)
            if isinstance(heads, int) and heads % self.tp:
                raise ValueError(
                    f"--tp {self.tp} does not divide the config's {key}={heads}: use a TP size "
                    f"that divides it"
                )
        if self.pp > 1 and (config.model_type not in DECODERS or is_masked_lm(config)):
            raise ValueError(
                f"--pp {self.pp} with a {config.model_type} model: pipeline stages split the "
                f"decoder families {list(DECODERS)}; use --pp 1"
            )
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
        if self.pp > layers + 2:
            raise ValueError(
                f"--pp {self.pp} exceeds the {layers + 2} pipeline blocks of the model"
            )

    def check(self) -> None:
        """Refuse an impossible run before any process group exists (the data are checked by
        ``load_data``)."""
        self._check_model_flags()
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
        if not self.hf_config:
            self.model().check(self.tp, self.pp, self.ep)


# -- data --------------------------------------------------------------------------------------
def load_data(cfg: TrainConfig, check: bool = True):
    """This run's token ids (``fastpar.data.load_tokens``), every id checked against the
    vocabulary unless ``check`` is False (one pass; the launcher checks once, before the ranks)."""
    tokens = load_tokens(cfg.data, tokenizer=cfg.tokenizer, dtype=cfg.data_dtype)
    if check:
        source = cfg.data or "the embedded corpus"
        if cfg.tokenizer and not (cfg.data or "").endswith((".npy", ".bin")):
            source += f" (tokenised with {cfg.tokenizer})"
        hint = ""
        if (cfg.data or "").endswith(".bin"):
            hint = f"; read as {cfg.data_dtype}: is --data-dtype the one the file was written with?"
        check_token_ids(tokens, cfg.vocab, source, min_tokens=cfg.seq_len + 2, hint=hint)
    return tokens


def batch_of(cfg: TrainConfig, tokens, step: int, hf=None):
    """The global batch of ``step``: next-token targets, or for a masked LM (BERT through
    --hf-config) masked inputs and their targets (-100 where nothing is predicted)."""
    x, y = global_batch(tokens, step, cfg.batch_size, cfg.seq_len, cfg.seed)
    if hf is not None and hf.masked:
        from fastpar.models.hf import masked_lm_batch

        x, y = masked_lm_batch(x, step, cfg.seed, hf.mask_id)
    return x, y


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

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, tokens=None):
        from fastpar.amp import DynamicLossScaler
        from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
        from fastpar.parallel import DistributedDataParallel
        from fastpar.zero import Zero3, ZeroOptimizer

        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.hf = None
        torch.manual_seed(cfg.seed)
        if cfg.hf_config:  # a Hugging Face model: built-in TP plan, decoder pipeline blocks
            from fastpar.models.hf import hf_blocks, load_config

            self.hf = hf_blocks(load_config(cfg.hf_config), mesh)
            self.model_cfg = self.hf  # holds vocab_size for the loss
            blocks, block_types, tied = self.hf.blocks, self.hf.block_types, None
        else:
            self.model_cfg = cfg.model()
            blocks = build_model(self.model_cfg, mesh)
            block_types = tuple({type(b) for b in blocks[1:-1]})  # ZeRO-3 gathers one at a time
            tied = untie_for_pipeline(blocks, mesh)
        stage, (self.start, _) = build_stage(
            blocks, mesh.pp_size, mesh.pp_rank, costs=[1.0] * len(blocks)
        )
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            cfg.precision
        ]
        stage = stage.to(device=device, dtype=dtype)
        if self.hf is not None:  # after the cast: the last stage copies the cast weight
            self.hf.tie(blocks, mesh)
        elif tied is not None:  # Module.to converts parameters in place: `tied` is still ours
            tie_across_stages(tied, mesh)
        del blocks
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
            model = opt = Zero3(
                stage, lambda gs: FusedAdamW(gs, lr=cfg.lr), mesh=mesh, param_groups=groups,
                wrap=block_types, scaler=scaler, max_grad_norm=cfg.max_grad_norm,
            )  # fmt: skip
        self.model, self.opt, self.scaler = model, opt, scaler
        sched = (GPipe if cfg.schedule == "gpipe" else OneFOneB)(cfg.microbatches)
        self.engine = PipelineEngine(
            model,
            mesh,
            sched,
            loss_fn=lambda logits, y: lm_loss(
                logits.flatten(0, -2).float(), y, self.model_cfg, mesh
            ),
            recompute=cfg.recompute,
            no_sync=no_sync,
            scale_loss=opt.scale_loss,
        )  # fmt: skip  (DDP / ZeRO sum the tied embedding's gradients themselves)
        self.tokens = tokens if tokens is not None else load_data(cfg, check=False)
        self.step_count = 0

    @property
    def param_groups(self):
        opt = self.opt
        return opt.optimizer.param_groups if hasattr(opt, "optimizer") else opt.param_groups

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters under the single-process model's names (Hugging Face's with
        --hf-config)."""
        from fastpar.checkpoint import stage_param_names

        if self.hf is not None:
            return self.hf.names(self.stage_module)
        return stage_param_names(self.stage_module, self.start)

    def step(self) -> dict:
        cfg, mesh = self.cfg, self.mesh
        lr = lr_at(cfg, self.step_count)
        for g in self.param_groups:
            g["lr"] = lr
        scale = self.scaler.scale if self.scaler is not None else 1.0
        for m in self.moes:  # aux losses enter backward like the main loss of a micro-batch
            m.aux_loss_scale = scale / cfg.microbatches
        x, y = batch_of(cfg, self.tokens, self.step_count, self.hf)
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


def run(cfg: TrainConfig, tokens=None) -> list[dict]:
    """Train on this rank (the default process group must exist). Returns the step records.
    ``tokens``: the run's data, already checked (None: load them, unchecked)."""
    mesh = ParallelMesh(cfg.tp, cfg.pp, cfg.ep)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    trainer = Trainer(cfg, mesh, device, tokens)
    talk = dist.get_rank() == 0 and not cfg.quiet
    start = 0
    if cfg.resume and cfg.checkpoint_dir:
        start = _resume(trainer, cfg.checkpoint_dir, talk)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    total_params = _global_param_count(trainer)
    if talk:
        n = sum(p.numel() for p in trainer.stage_module.parameters())
        print(
            f"fastpar.train: {cfg.model_name}, world {cfg.world_size} = dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} "
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
            every = cfg.save_every and rec["step"] % cfg.save_every == 0
            if cfg.checkpoint_dir and (every or rec["step"] == cfg.steps):  # the last step always
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
            step=step, extra={"step": step, "config": asdict(trainer.cfg)}, overwrite=True,
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
def _rank_main(cfg: TrainConfig, tokens=None) -> list[dict]:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return run(cfg, tokens)


def launch(cfg: TrainConfig, timeout: float = 24 * 3600.0, tokens=None) -> list[dict]:
    """Run ``cfg`` on this machine: under torchrun on its ranks, else on ranks started here.
    Returns rank 0's step records. The data are loaded and every id checked first, before any
    rank starts (under torchrun: before the process group); ``tokens`` passes data already
    checked (``load_data``)."""
    cfg.check()
    if tokens is None:
        tokens = load_data(cfg)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from fastpar.mesh import init

        if int(os.environ["WORLD_SIZE"]) != cfg.world_size:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but tp*pp*dp = {cfg.tp}*{cfg.pp}*"
                f"{cfg.dp} = {cfg.world_size}; pass --dp {int(os.environ['WORLD_SIZE']) // (cfg.tp * cfg.pp)}"
            )
        from datetime import timedelta

        init(cfg.tp, cfg.pp, cfg.ep, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return _rank_main(cfg, tokens)
    from fastpar.testing import run_ranks

    if torch.cuda.is_available():
        if torch.cuda.device_count() < cfg.world_size:
            raise ValueError(
                f"{cfg.world_size} ranks need {cfg.world_size} GPUs, {torch.cuda.device_count()} visible"
            )
        # spawned ranks load the data again (memory-mapped or re-tokenised), unchecked
        out = run_ranks(
            _rank_main, cfg.world_size, cfg, backend="nccl", start_method="spawn", timeout=timeout
        )
    else:  # forked ranks share the parent's tokens
        out = run_ranks(_rank_main, cfg.world_size, cfg, tokens, timeout=timeout)
    return out[0]


#: flags whose default is None: (type, help)
_OPTIONAL_FLAGS = {
    "vocab_size": (int, "vocabulary size (default: the tokenizer's, else 256 bytes)"),
    "ffn": (int, "MLP width (default: gpt 4·hidden, llama 8·hidden/3 rounded up to 64)"),
    "moe_ffn": (int, "llama: width of each expert (default: --ffn)"),
    "kv_heads": (int, "llama: key/value heads for grouped-query attention (default: heads)"),
    "head_dim": (int, "llama: width of a head (default: hidden / heads)"),
    "capacity_factor": (float, "MoE capacity factor (default: dropless)"),
    "data": (str, "a text file, a .npy or a .bin file of token ids (default: embedded corpus)"),
    "tokenizer": (str, "a tokenizer.json (HF tokenizers) for text data; sets the vocabulary"),
    "ep": (int, "expert-parallel size (default 2; 1 with --hf-config)"),
    "hf_config": (
        str,
        "a Hugging Face config.json: train that model (random init) with its "
        "family's built-in plan instead of the GPT / Llama",
    ),
    "checkpoint_dir": (str, None),
    "profile": (str, None),
}
_HELP = {
    "model_type": "gpt or llama",
    "data_dtype": "ids of a .bin file: uint16 or uint32",
    "qk_norm": "llama: Qwen3-style RMSNorm on every query and key head",
    "attention_bias": "llama: Qwen2-style q/k/v bias",
    "rope_theta": "llama: RoPE base",
}


def build_parser(prog: str = "python -m fastpar.train") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--model" if f.name == "model_type" else "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        extra = f"{_HELP[f.name]} " if f.name in _HELP else ""
        if isinstance(value, bool):
            ap.add_argument(flag, action="store_true", help=f"{extra}(default {value})")
        elif f.name in _OPTIONAL_FLAGS:
            kind, text = _OPTIONAL_FLAGS[f.name]
            ap.add_argument(flag, type=kind, default=None, help=text)
        else:
            ap.add_argument(
                flag, dest=f.name, type=type(value), default=value,
                metavar="{gpt,llama}" if f.name == "model_type" else None,
                help=f"{extra}(default {value})",
            )  # fmt: skip
    return ap


def config_from(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if values["ep"] is None:  # the default: expert parallelism for fastpar's MoE models only
        values["ep"] = 1 if values["hf_config"] else TrainConfig.ep
    return TrainConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from(args)
    try:
        cfg.check()
        tokens = load_data(cfg)  # every id checked against the vocabulary, before any rank
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = launch(cfg, tokens=tokens)
    if records and not cfg.quiet and "RANK" not in os.environ:
        first, last = records[0]["loss"], records[-1]["loss"]
        print(
            f"done: loss {first:.4f} -> {last:.4f} over {len(records)} steps; config {asdict(cfg)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
