"""What a run says about itself: the header (the layout and every setting that changes the
math), the note about the default world on a small machine, and the end-of-run summary. Pure
functions of the config and numbers, so each is tested directly."""

from __future__ import annotations

import os

from fastpar.models import native

#: the flags that choose the layout; without any of them the run takes the default world
LAYOUT_FLAGS = ("--dp", "--tp", "--pp", "--cp", "--ep", "--dp-shard", "--dp-replicate")


def model_label(cfg) -> str:
    """The model as the header names it: "gpt", "llama", or an --hf-config model's family
    (its config's model_type) with the file."""
    if not cfg.hf_config:
        return cfg.model_type
    from fastpar.models.hf import read_config_json

    return f"{read_config_json(cfg.hf_config)['model_type']} (--hf-config {cfg.hf_config})"


def moe_text(cfg) -> str:
    """The MoE settings in a few words: where the blocks are, then ``moe_router``'s and
    ``moe_experts``' own words (``RouterConfig.words``, ``ExpertConfig.words``)."""
    moe_where = None if cfg.hf_config else native.get(cfg.model_type).moe_where
    model = cfg.model
    where = moe_where(model) if moe_where is not None else f"every {model.moe_every}"
    score, *routing = model.moe_router.words()
    head = f"MoE {where}: top-{model.top_k} of {model.num_experts} experts ({score})"
    parts = [head, *routing, *model.moe_experts.words()]
    if model.moe_expert_tp:
        parts.append("expert TP")
    return ", ".join(parts)


def math_settings(cfg) -> list[str]:
    """The settings beyond the layout that change what a step computes, as words."""
    out = [f"{cfg.loss_normalization} loss normalisation"]
    if cfg.recompute:
        out.append(f"recompute {cfg.recompute_policy}")
    if cfg.compile:
        out.append("compile")
    if cfg.model.sequence_parallel:
        out.append("sequence parallel")
    if cfg.fused_ce:
        out.append("fused CE")
    if cfg.packs_documents:
        out.append("packed documents")
    if cfg.plan:
        out.append(f"--plan {cfg.plan}")
    model, depth = cfg.model, getattr(cfg.model, "mtp_depth", 0)
    if not cfg.hf_config and any(model.is_moe(i) for i in range(model.layers + depth)):
        out.append(moe_text(cfg))  # fastpar's model has MoE blocks
    if cfg.optimizer.state_dtype != "fp32":
        out.append(f"AdamW moments in {cfg.optimizer.state_dtype}")
    if depth:
        out.append(f"MTP depth {depth} (loss coef {cfg.model.mtp_loss_coef:g})")
    return out


def hybrid_text(cfg) -> str:
    """ " (dp-shard S x dp-replicate R)" under hybrid sharding (--dp-replicate > 1), else ""."""
    s, r = cfg.dp_shard, cfg.dp_replicate
    if s is None and r is None:
        return ""
    s, r = s or cfg.dp // r, r or cfg.dp // s
    return f" (dp-shard {s} x dp-replicate {r})" if r > 1 else ""


def header_line(cfg, backend: str, total_params: int, held: int) -> str:
    """Rank 0's first line: the model, the layout, and every setting that changes the math."""
    return (
        f"fastpar.train: {model_label(cfg)}, world {cfg.world_size} = dp {cfg.dp}"
        f"{hybrid_text(cfg)} x tp {cfg.tp} "
        f"x pp {cfg.pp}{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} (ep {cfg.ep}), ZeRO-{cfg.zero}, "
        f"{cfg.precision}{f' {cfg.fp8.recipe}' if cfg.precision == 'fp8' else ''}, {cfg.schedule_label} x {cfg.microbatches} micro-batches, {backend}; "
        f"{'; '.join(math_settings(cfg))}; {total_params:,} parameters, rank 0 holds {held:,}"
    )


def _groups_text(groups: list[list[int]], most: int = 4) -> str:
    shown = " ".join(str(g) for g in groups[:most])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > most else "")


def hybrid_line(cfg, layout) -> str:
    """Rank 0's second line under hybrid sharding: the groups ZeRO shards over and those the
    reduced shards are all-reduced over (``fastpar.mesh.MeshLayout`` groups)."""
    shard = "dp-shard-cp" if layout.cp > 1 else "dp-shard"
    return (
        f"hybrid sharding: dp {layout.dp} = dp-shard {layout.dp_shard} x dp-replicate "
        f"{layout.dp_replicate}; ZeRO-{cfg.zero} shards over {shard} "
        f"{_groups_text(layout.groups['dp-shard-cp'])}, all-reduces each reduced shard over "
        f"dp-replicate {_groups_text(layout.groups['dp-replicate'])}"
    )


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def layout_given(argv: list[str], file_values: dict | None = None) -> bool:
    """Whether the command line (or its --config file's values) chose any of the layout."""
    flags = any(a == f or a.startswith(f + "=") for a in argv for f in LAYOUT_FLAGS)
    return flags or any(k in (file_values or {}) for k in ("dp", "tp", "pp", "cp", "ep"))


def default_world_note(cfg, given: bool, cores: int) -> str | None:
    """One line when no layout flag was given and the default world has more ranks than this
    machine has CPU cores (every rank a process: slow, not wrong); else None."""
    if given or cores >= cfg.world_size:
        return None
    layout = f"dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp}" + (f" x cp {cfg.cp}" if cfg.cp > 1 else "")
    return (
        f"note: no layout flags: running the default world of {cfg.world_size} ranks ({layout}) "
        f"on {cores} CPU core{'s' if cores != 1 else ''}; pass --dp/--tp/--pp to choose"
    )


def done_line(cfg, records: list[dict]) -> str:
    """The end of a run: the loss, the speed, where the checkpoint and the settings are."""
    first, last = records[0]["loss"], records[-1]["loss"]
    tps = records[-1].get("run_tokens_per_s")
    speed = f", {tps:,.0f} tok/s" if tps else ""
    text = f"done: loss {first:.4f} -> {last:.4f} over {len(records)} steps{speed}"
    if not cfg.checkpoint_dir:
        return text + "; nothing saved (no --checkpoint-dir)"
    from fastpar.checkpoint.directory import step_dir
    from fastpar.train.checkpointing import CONFIG_FILE

    where = step_dir(cfg.checkpoint_dir, records[-1]["step"])
    return f"{text}; checkpoint {where}, settings {os.path.join(cfg.checkpoint_dir, CONFIG_FILE)}"
