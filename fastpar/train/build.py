"""What a run trains, built one way for the trainer and for ``fastpar.verify``'s reference.

``build(cfg, mesh, device)``: this rank's blocks (its pipeline stage; the whole model when
``mesh`` is None), cast to the run's precision and tied, the optimizer's parameter groups, the
fp16 loss scaler, the data-parallel wrapper of the ZeRO stage (which owns the optimizer step)
and the loss. ``Trainer``: those parts, the pipeline engine, and a step. The reference's
differences: docs/training.md ("Inside fastpar.train")."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from fastpar.amp import AmpOptimizer, DynamicLossScaler
from fastpar.checkpoint import stage_param_names
from fastpar.comm import plain
from fastpar.debug import debug_checks
from fastpar.mesh import ParallelMesh
from fastpar.models import build_model, untie_for_pipeline
from fastpar.models.common import IGNORE_INDEX, loss_groups
from fastpar.models.documents import valid_targets
from fastpar.models.mtp import MTPOutput, mtp_loss
from fastpar.moe import TopKRouter, moe_layers, update_expert_bias
from fastpar.nn import use_fp8
from fastpar.optim import FusedAdamW, MixedPrecisionOptimizer
from fastpar.optim.config import TORCH_STATE_DTYPES
from fastpar.parallel import DataParallel, Replicate, Shard
from fastpar.parallel.pipeline import (
    SCHEDULES,
    PipelineEngine,
    build_stage,
    build_virtual_stages,
    make_schedule,
    tie_across_stages,
)
from fastpar.parallel.pipeline.recompute import apply_recompute
from fastpar.profiling import nvtx
from fastpar.tolerance import cast, nudge
from fastpar.train.batches import (
    as_data,
    batch_of,
    eval_batch,
    load_data,
    lr_at,
    microbatch_context,
    split_tokens,
)
from fastpar.train.config import TrainConfig
from fastpar.train.optimizers import exact_optimizer, groups_for, muon_factory

DTYPES = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16, fp8=torch.bfloat16)


@dataclass
class Parts:
    """One rank's share of a run (``mesh`` None: the whole model on one process).

    ``module``: the stage's blocks (``nn.Sequential``, numbered from 0; block ``start`` of the
    whole model is its first; with --schedule interleaved a ``VirtualStages`` whose blocks
    carry the whole model's numbers, ``start`` 0); ``model``: what the engine runs (``module`` wrapped in the
    data-parallel wrapper; ``module`` itself without a mesh); ``opt``: the optimizer wrapper
    (``fastpar.amp.AmpOptimizer``: ``step() -> (skipped, norm)``, ``scale_loss``,
    ``param_groups``; with a mesh the wrapper itself); ``no_sync``: the wrapper's
    gradient-accumulation context (None without a mesh); ``loss_fn(logits, targets)``: the mean
    loss of a micro-batch; ``aux_scale``: without a mesh, the 0-dim tensor every MoE layer
    scales its auxiliary loss's gradient by (``update_aux_scale``; with a mesh the engine sets
    the weight, and this is None); ``bias_routers``: the stage's routers with an expert bias
    (aux-loss-free balancing; ``update_expert_bias`` after each optimizer step)."""

    cfg: TrainConfig
    module: nn.Sequential
    start: int
    hf: object | None
    model_cfg: object
    model: nn.Module
    opt: AmpOptimizer
    scaler: DynamicLossScaler | None
    no_sync: Callable | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    aux_scale: torch.Tensor | None
    bias_routers: list[TopKRouter] = field(default_factory=list)
    mtp_terms: list = field(default_factory=list)
    """--mtp-depth: each training micro-batch's MTP loss without its coefficient, detached, as
    ``loss_fn`` returned it (``fastpar.models.mtp.mtp_loss``'s ``parts``); the trainer reads
    and clears it every step."""

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters under the single-process model's names (Hugging Face's with
        --hf-config)."""
        if self.hf is not None:
            return self.hf.names(self.module)
        return stage_param_names(self.module, self.start)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What the trainer's checkpoints save and restore: the parameters
        (``named_parameters``) and the MoE routers' ``expert_bias`` buffers under the
        single-process model's names (``i.mlp.router.expert_bias``; fp32, replicated like the
        router: written once, by DP rank 0 and TP rank 0). The routers' token counts are not
        saved: they are zero between steps (``update_expert_bias`` resets them). With
        --hf-config: the parameters and the HF blocks' persistent buffers under HF names
        (DeepSeek-V3's router ``gate.e_score_correction_bias``)."""
        tensors = dict(self.named_parameters())
        if self.hf is None:
            tensors.update(expert_bias_names(self.module, self.start))
        else:
            tensors.update(self.hf.buffers(self.module))
        return tensors

    def update_expert_bias(self, skipped: torch.Tensor | bool, group) -> None:
        """After an optimizer step: every expert-bias router of the stage moves its bias from
        the tokens this step's training forwards routed, summed over ``group`` (the
        data-parallel group, whose ranks hold replicas of these routers; None: this process) —
        one all-reduce, no host sync. A skipped step (``skipped``: inf/NaN gradients, agreed on
        every rank) moves no bias (docs/moe.md): its counts are zeroed on the device first, then
        reset. A no-op without expert-bias routers."""
        if not self.bias_routers:
            return
        device = self.bias_routers[0].tokens_per_expert.device
        keep = torch.logical_not(torch.as_tensor(skipped, device=device)).to(torch.int64)
        for router in self.bias_routers:
            router.tokens_per_expert.mul_(keep)
        update_expert_bias(self.module, group)

    def update_aux_scale(self) -> None:
        """Without a mesh (the single-process reference), before a step: the MoE auxiliary
        losses enter backward like the main loss of a micro-batch (1 / micro-batches, times the
        loss scale), the weight ``PipelineEngine`` sets for a distributed run. A device op, no
        host sync; a constant without a loss scaler."""
        if self.scaler is not None and self.aux_scale is not None:
            torch.div(self.scaler.scale, self.cfg.microbatches, out=self.aux_scale)


def _blocks(cfg: TrainConfig, mesh: ParallelMesh | None):
    """(blocks of the whole model, built for ``mesh``; the HF parts or None; the model's
    config; ZeRO-3's gather units; this rank's tied embedding or None)."""
    if cfg.hf_config:  # a Hugging Face model: built-in TP plan, decoder pipeline blocks
        from fastpar.models.hf import hf_blocks, load_config, read_plan  # transformers: on use

        plan = read_plan(cfg.plan) if cfg.plan else None
        hf = hf_blocks(load_config(cfg.hf_config), mesh, plan, cfg.plan or "")
        return hf.blocks, hf, hf, hf.block_types, None  # the HF parts hold vocab_size
    model_cfg = cfg.model
    blocks = build_model(model_cfg, mesh)
    block_types = tuple({type(b) for b in blocks[1:-1]})  # ZeRO-3 gathers one at a time
    return blocks, None, model_cfg, block_types, untie_for_pipeline(blocks, mesh)


def expert_bias_names(stage: nn.Module, start: int) -> dict[str, torch.Tensor]:
    """The ``expert_bias`` buffers of a stage's routers under global names, numbered like
    ``stage_param_names`` (block i of the stage is block ``start + i`` of the model)."""
    out = {}
    for name, buf in stage.named_buffers():
        if not name.endswith("expert_bias"):
            continue
        head, _, rest = name.partition(".")
        if not head.isdigit():
            raise ValueError(f"buffer {name!r} is not inside a numbered block of the stage")
        out[f"{start + int(head)}.{rest}"] = buf
    return out


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on matrices (dim >= 2), none on vectors; empty ones left out."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _optimizer(cfg, stage, groups, mesh: ParallelMesh | None, scaler, block_types, exact=False):
    """(what the engine runs, the optimizer wrapper): the data-parallel wrapper of the ZeRO stage,
    which owns the optimizer step and sums the tied embedding's gradients itself; ``mesh`` None: the
    plain module and the mixed-precision AdamW of one process. Interleaved: the engine runs only
    this rank's last backward outside no_sync, which gives the other chunks' parameters no gradient:
    they count as what no_sync accumulated (``find_unused_parameters``), so each is reduced once."""
    state_dtype = TORCH_STATE_DTYPES[cfg.optimizer.state_dtype]  # the moments' (fp32, bf16)
    adamw = lambda gs: FusedAdamW(gs, lr=cfg.lr, state_dtype=state_dtype)  # noqa: E731
    adamw, clip = muon_factory(cfg) or adamw, cfg.max_grad_norm  # --optimizer muon
    if exact:  # the same step in float64, the moments stored rounded (fastpar.verify's exact)
        return stage, exact_optimizer(cfg, groups, clip, state_dtype)
    if mesh is None:
        return stage, MixedPrecisionOptimizer(adamw(groups), scaler=scaler, max_grad_norm=clip)
    wrapper = Replicate  # ZeRO 0
    if cfg.zero:  # ZeRO-3 gathers one transformer block at a time
        wrapper = partial(Shard, stage=cfg.zero, wrap=block_types if cfg.zero == 3 else None)
    model: DataParallel = wrapper(
        stage,
        adamw,
        mesh=mesh,
        param_groups=groups,
        scaler=scaler,
        max_grad_norm=clip,
        find_unused_parameters=cfg.virtual_stages > 1,
    )
    return model, model


def build(
    cfg: TrainConfig,
    mesh: ParallelMesh | None,
    device: torch.device,
    *,
    exact: bool = False,
    twin: bool = False,
) -> Parts:
    """This rank's parts of ``cfg`` (see docs/training.md); ``mesh`` None: the whole
    model on one process. The same seed gives the same weights on any layout. For
    ``fastpar.verify``'s references (``mesh`` None): ``exact`` builds the same model and step in
    float64 (``fastpar.train.optimizers.exact_optimizer``, no loss scaling, the plain loss), and
    ``twin`` moves every starting weight by one rounding (``fastpar.tolerance.nudge``)."""
    if (exact or twin) and mesh is not None:
        raise ValueError("exact / twin build the single-process reference: pass mesh=None")
    torch.manual_seed(cfg.seed)
    blocks, hf, model_cfg, block_types, tied = _blocks(cfg, mesh)
    head = blocks[-1]
    if cfg.fused_ce and not exact:  # the head hands its hidden states to the fused linear CE
        head.return_hidden = True
    if mesh is not None:  # a selective --recompute (the reference keeps every activation)
        apply_recompute(blocks[1:-1], cfg.recompute_policy)
    pp_size, pp_rank = (mesh.pp_size, mesh.pp_rank) if mesh is not None else (1, 0)
    costs = [1.0] * len(blocks)
    if mesh is not None and cfg.virtual_stages > 1:  # chunks keep the whole model's numbers
        stage, _ = build_virtual_stages(blocks, pp_size, pp_rank, cfg.virtual_stages, costs=costs)
        start = 0
    else:
        stage, (start, _) = build_stage(blocks, pp_size, pp_rank, costs=costs)
    stage = cast(stage.to(device), torch.float64 if exact else DTYPES[cfg.precision])
    if cfg.precision == "fp8" and not exact:
        use_fp8(stage, cfg.fp8.recipe, exclude=cfg.fp8.exclude_patterns)
    if cfg.init_from_hf:  # this rank's slices of the pretrained weights (a resumed run's
        # checkpoint overwrites them, and the optimizer state, in ``open_checkpoints``)
        from fastpar.models.hf import load_pretrained

        load_pretrained(hf, stage, cfg.init_from_hf)
    if twin:
        nudge(stage, cfg.seed)
    if mesh is not None and hf is not None:  # after the cast: the last stage copies the weight
        hf.tie(blocks, mesh)
    elif tied is not None:  # Module.to converts parameters in place: `tied` is still ours
        tie_across_stages(tied, mesh)
    fp16 = cfg.precision == "fp16" and not exact
    scaler = DynamicLossScaler(initial_scale=cfg.loss_scale, device=device) if fp16 else None
    groups = groups_for(cfg, stage, param_groups)
    model, opt = _optimizer(cfg, stage, groups, mesh, scaler, block_types, exact)
    no_sync = None if mesh is None else model.no_sync
    moes = moe_layers(stage)
    aux_scale = None
    if mesh is None:  # no engine: the layers read this weight (updated in place, never reassigned)
        aux_dtype = torch.float64 if exact else torch.float32
        aux_scale = torch.full((), 1.0 / cfg.microbatches, dtype=aux_dtype, device=device)
        for m in moes:
            m.aux_loss_scale = aux_scale

    # "token": the sum over the valid targets (the engine, or the reference, divides by the
    # global batch's count); "sequence": the micro-batch's mean
    red = "sum" if cfg.loss_normalization == "token" else "mean"
    # every forward before any backward (GPipe): the fused CE recomputes its logits in backward
    forwards_first = SCHEDULES[cfg.schedule].forwards_first
    mtp_terms: list = []
    loss_on = loss_groups(mesh)  # read once: the loss runs every micro-batch

    def loss_fn(logits: torch.Tensor | MTPOutput, targets: torch.Tensor) -> torch.Tensor:
        # (mtp_loss: lm_loss itself for a tensor; with --mtp-depth the same call per depth)
        if exact:  # the same math as either path below (the head returned logits), in float64
            return mtp_loss(_each(logits, _rows), targets, model_cfg, loss_on, reduction=red)
        if cfg.fused_ce:  # the head's weight read now: a pipeline's last stage holds a copy
            return mtp_loss(
                _each(logits, _rows),
                targets,
                model_cfg,
                loss_on,
                weight=head.weight,
                recompute=forwards_first,
                reduction=red,
                parts=mtp_terms,
            )
        # nothing reads the logits after the loss: their gradient takes their buffer
        return mtp_loss(
            _each(logits, lambda t: _rows(t).float()),
            targets,
            model_cfg,
            loss_on,
            inplace_backward=True,
            reduction=red,
            parts=mtp_terms,
        )

    bias_routers = [m.router for m in moes if m.router.expert_bias is not None]
    return Parts(
        cfg,
        stage,
        start,
        hf,
        model_cfg,
        model,
        opt,
        scaler,
        no_sync,
        loss_fn,
        aux_scale,
        bias_routers,
        mtp_terms,
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(0, -2)


def _each(out, fn):
    """``fn`` of the head's output: of the logits, or of each of an ``MTPOutput``'s."""
    return out.map(fn) if isinstance(out, MTPOutput) else fn(out)


# -- one rank ----------------------------------------------------------------------------------
class Trainer:
    """This rank's parts (``build``), its pipeline engine and data; ``step()`` trains one step
    without a host sync (see ``step``)."""

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, tokens=None):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        if cfg.debug_checks:  # cross-rank input checks in this rank (also FASTPAR_DEBUG_CHECKS=1)
            debug_checks(True)
        self.parts = parts = build(cfg, mesh, device)
        self.stage_module, self.start, self.hf = parts.module, parts.start, parts.hf
        self.model_cfg, self.model, self.opt = parts.model_cfg, parts.model, parts.opt
        self.scaler = parts.scaler
        sched = make_schedule(
            cfg.schedule, cfg.microbatches, cfg.virtual_stages, cfg.microbatch_group_size
        )
        stage = parts.model if cfg.virtual_stages == 1 else parts.module  # chunks: run directly
        self.engine = PipelineEngine(
            stage,
            mesh,
            sched,
            loss_fn=parts.loss_fn,
            recompute=cfg.recompute is True,
            grad_sync=parts.model,
            scale_loss=parts.opt.scale_loss,
            normalization=cfg.loss_normalization,
        )
        tokens = as_data(cfg, tokens) if tokens is not None else load_data(cfg, check=False)
        self.tokens, self.held_out = split_tokens(cfg, tokens)  # (held_out None: no eval)
        self.step_count = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.parts.param_groups

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters under the single-process model's names (Hugging Face's with
        --hf-config)."""
        return self.parts.named_parameters()

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What this rank's checkpoints hold: its parameters and routers' expert biases
        (``Parts.checkpoint_tensors``)."""
        return self.parts.checkpoint_tensors()

    def _batch(self, step: int, held_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel replica's rows of the global batch of ``step`` (``held_out``: of
        validation batch ``step``), on the device (from pinned memory without waiting, on a
        GPU). Sets ``valid_tokens``: the global batch's count of valid targets, read on the
        host from the batch every rank draws alike (no collective, no device sync)."""
        cfg, mesh = self.cfg, self.mesh
        if held_out:
            x, y, docs = eval_batch(cfg, self.held_out, step, self.hf)
        else:
            x, y, docs = batch_of(cfg, self.tokens, step, self.hf)
        self.valid_tokens = valid_targets(y, IGNORE_INDEX)  # (host memory: no device sync)
        per = cfg.batch_size // mesh.dp_size
        rows = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
        x, y = x[rows], y[rows]
        if self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
            y = y.pin_memory().to(self.device, non_blocking=True)
        docs = None if docs is None else docs.rows(rows)
        mtp = getattr(self.model_cfg, "mtp_depth", 0) > 0
        self.context = microbatch_context(docs, x, cfg.microbatches, self.device, mtp)
        return x, y

    def step(self) -> dict:
        """One training step; no host sync: the record's ``loss`` (this rank's, None off the
        last pipeline stage; not yet averaged over data parallelism), ``grad_norm`` and
        ``skipped`` are 0-dim device tensors, turned into numbers on the steps that read them
        (``fastpar.train.metrics.resolve``). ``seconds``: the host's time in the step."""
        cfg, mesh = self.cfg, self.mesh
        lr = lr_at(cfg, self.step_count)
        for g in self.param_groups:
            g["lr"] = lr
        x, y = self._batch(self.step_count)
        t0 = time.perf_counter()
        if self.valid_tokens == 0 and cfg.loss_normalization == "token":
            return self._empty_step(lr, t0)
        self.parts.mtp_terms.clear()
        loss = self.engine.train_step(
            x if mesh.is_first_stage else None,
            y if mesh.is_last_stage else None,
            broadcast_loss=False,
            valid_tokens=self._count(),
            context=self.context,
        )
        with nvtx("optimizer step"):
            skipped, norm = self.opt.step()
        self.parts.update_expert_bias(skipped, mesh.dp_group)  # (--expert-bias: one all-reduce)
        self.opt.zero_grad()
        self.step_count += 1
        return {
            "step": self.step_count,
            "lr": lr,
            "seconds": time.perf_counter() - t0,
            "loss": None if loss is None else loss.detach().float(),
            "grad_norm": norm,
            "skipped": skipped,
            **self._mtp_record(),
        }

    def _mtp_record(self) -> dict:
        """--mtp-depth: {"mtp_loss": the step's MTP loss without its coefficient, weighted as
        the engine weighs each micro-batch's loss (None off the last stage)}; else {}."""
        if not getattr(self.model_cfg, "mtp_depth", 0):
            return {}
        terms = self.parts.mtp_terms
        if not self.mesh.is_last_stage or not terms:
            return {"mtp_loss": None}
        if self.cfg.loss_normalization == "token":  # the engine's dp·cp / the global count
            weight = self.mesh.dp_size * self.mesh.cp_size / max(1, self.valid_tokens)
        else:
            weight = 1.0 / self.cfg.microbatches
        return {"mtp_loss": torch.stack(terms).sum().float() * weight}

    def _count(self):
        """The global count of valid targets for the engine ("token" normalisation), or None."""
        return self.valid_tokens if self.cfg.loss_normalization == "token" else None

    def _empty_step(self, lr: float, t0: float) -> dict:
        """A step whose global batch has no valid target ("token" normalisation): nothing to
        learn from, so no forward, no backward and no optimizer step (the weights, the moments
        and the step count stay as they were, on every rank alike: every rank drew the same
        batch); recorded as skipped, with loss and gradient norm 0, and said on rank 0."""
        self.step_count += 1
        if torch.distributed.get_rank() == 0 and not self.cfg.quiet:
            print(
                f"step {self.step_count}: the global batch has no valid target (every target "
                "ignored); step skipped",
                flush=True,
            )
        zero = torch.zeros((), device=self.device)
        return {
            "step": self.step_count,
            "lr": lr,
            "seconds": time.perf_counter() - t0,
            "loss": zero if self.mesh.is_last_stage else None,
            "grad_norm": zero.clone(),
            "skipped": torch.ones((), dtype=torch.bool, device=self.device),
        }

    def evaluate(self) -> float:
        """The validation loss over ``--eval-batches`` held-out batches, pipelined forward-only
        (``PipelineEngine.eval_step``) and averaged over data parallelism; the same number on
        every rank (one host sync). Under "token" normalisation every valid target of every
        batch counts once: each batch's loss weighs by its count of valid targets (a batch's
        mean of a few targets does not weigh as much as one of many); under "sequence" the
        batches' means are averaged."""
        mesh, total, count = self.mesh, None, 0
        for j in range(self.cfg.eval_batches):
            x, y = self._batch(j, held_out=True)
            with nvtx(f"eval batch {j}"):
                loss = self.engine.eval_step(
                    x if mesh.is_first_stage else None,
                    y if mesh.is_last_stage else None,
                    valid_tokens=self._count(),
                    context=self.context,
                )  # (broadcast over the pipeline)
            weight = self.valid_tokens if self._count() is not None else 1
            part = loss.float() * weight
            total, count = (part if total is None else total + part), count + weight
        total = total / max(count, 1)
        if mesh.dp_size * mesh.cp_size > 1:  # cp ranks: each its chunks' mean
            plain.all_reduce(total, group=mesh.dp_cp_group)
            total = total / (mesh.dp_size * mesh.cp_size)
        return float(total)
