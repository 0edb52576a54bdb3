"""``Trainer``: this rank's model stage, data-parallel wrapper, optimizer and pipeline engine."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fastpar.debug import debug_checks
from fastpar.mesh import ParallelMesh
from fastpar.models import build_model, lm_loss, untie_for_pipeline
from fastpar.moe import MoE
from fastpar.parallel.pipeline import (
    GPipe,
    OneFOneB,
    PipelineEngine,
    build_stage,
    tie_across_stages,
)
from fastpar.profiling import nvtx
from fastpar.train.batches import batch_of, load_data, lr_at
from fastpar.train.config import TrainConfig


# -- one rank ----------------------------------------------------------------------------------
class Trainer:
    """Builds this rank's stage, optimizer and pipeline engine; runs steps."""

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, tokens=None):
        from fastpar.amp import DynamicLossScaler
        from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
        from fastpar.parallel import DistributedDataParallel
        from fastpar.zero import Zero3, ZeroOptimizer

        self.cfg, self.mesh, self.device = cfg, mesh, device
        if cfg.debug_checks:  # cross-rank input checks in this rank (also FASTPAR_DEBUG_CHECKS=1)
            debug_checks(True)
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
