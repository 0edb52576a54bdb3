"""The checks of a run's flags that combine several of them, each taking the ``TrainConfig``
as ``cfg`` (``TrainConfig.check`` calls them): --init-from-hf's directory, packed documents,
context parallelism, the schedule's refusals, the layout (the mesh's own refusals, hybrid
sharding's among them), and the words a flag takes. Each failure is one
ValueError line naming the value and the fix."""

from __future__ import annotations

import os
from dataclasses import fields

from fastpar.cliutil import option_of
from fastpar.mesh import MeshLayout
from fastpar.mesh.layout import resolve_dp
from fastpar.optim.config import OptimizerConfig
from fastpar.parallel.pipeline.schedules import SCHEDULES, accepting
from fastpar.train.checks import flag


def mesh_layout(cfg) -> MeshLayout:
    """The run's ``MeshLayout`` (ValueError for an impossible one, naming the flags)."""
    resolve_dp(cfg.dp, cfg.dp_shard, cfg.dp_replicate, ("--dp", "--dp-shard", "--dp-replicate"))
    try:
        return MeshLayout(
            cfg.world_size,
            tp=cfg.tp,
            pp=cfg.pp,
            ep=cfg.ep,
            cp=cfg.cp,
            dp_shard=cfg.dp_shard,
            dp_replicate=cfg.dp_replicate,
        )
    except ValueError as exc:
        if cfg.dp_shard is None and cfg.dp_replicate is None:
            raise
        text = str(exc).replace("dp_shard", "--dp-shard").replace("dp_replicate", "--dp-replicate")
        raise ValueError(text) from None


def check_layout(cfg) -> None:
    """The layout exists; hybrid sharding (--dp-replicate > 1) needs a ZeRO stage to shard."""
    layout = mesh_layout(cfg)
    if layout.hybrid and cfg.zero == 0:
        raise ValueError(
            f"--dp-shard {layout.dp_shard} --dp-replicate {layout.dp_replicate} with --zero 0: "
            f"hybrid sharding shards ZeRO's state inside each dp-shard group, and at --zero 0 "
            f"nothing is sharded; pass --zero 1, 2 or 3, or drop --dp-shard / --dp-replicate"
        )


def check_words(cfg) -> None:
    """Every flag that takes words (``Option.words``) holds one of them (None: left out), for
    whatever the other checks of ``TrainConfig.check`` do not name with their own fix."""
    for f in fields(cfg):
        value, words = getattr(cfg, f.name), tuple(option_of(f).words)
        if words and value is not None and value not in words:
            raise ValueError(
                f"{flag(f.name)} {value!r} must be one of {', '.join(map(str, words))}"
            )


def check_init_from_hf(cfg) -> None:
    """--init-from-hf DIR: a save_pretrained directory whose config.json is --hf-config's."""
    from fastpar.models.hf import read_config_json

    what, implied = (
        f"--init-from-hf {cfg.init_from_hf}",
        os.path.join(cfg.init_from_hf, "config.json"),
    )
    if not os.path.isfile(implied):
        raise ValueError(
            f"{what} holds no config.json: pass a directory written by save_pretrained "
            "(config.json + model.safetensors or its index)"
        )
    if not any(n.endswith(".safetensors") for n in os.listdir(cfg.init_from_hf)):
        raise ValueError(
            f"{what} holds no *.safetensors weights: save the model with "
            "save_pretrained(DIR) (safe_serialization, the default) and pass that DIR"
        )
    if os.path.abspath(cfg.hf_config) != os.path.abspath(implied):
        skip = ("transformers_version", "_name_or_path")
        ours, theirs = (
            {k: v for k, v in read_config_json(p).items() if k not in skip}
            for p in (cfg.hf_config, implied)
        )
        keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if keys:
            raise ValueError(
                f"--hf-config {cfg.hf_config} differs from {implied} ({', '.join(keys[:4])}): "
                f"{what} trains the model of its own config.json; drop --hf-config"
            )


def check_packing(cfg) -> None:
    """--pack / --eos-id: what packed documents can run exactly."""
    if cfg.eos_id is not None and not 0 <= cfg.eos_id < cfg.vocab:
        raise ValueError(
            f"--eos-id {cfg.eos_id} is not a token id of the {cfg.vocab}-token vocabulary"
        )
    if cfg.pack == "documents" and cfg.document_source is None:
        raise ValueError(
            "--pack documents needs document boundaries: pass --eos-id ID (the token that ends "
            "each document in --data), a --tokenizer with an end-of-document token, a .bin "
            "with its .idx of document offsets, or a .jsonl; or use --pack stream"
        )
    if cfg.pack == "stream" and (cfg.data or "").endswith(".jsonl"):
        raise ValueError(
            f"--pack stream with {cfg.data}: a .jsonl holds documents with prompt tokens the "
            "loss must ignore, which a stream would train on; drop --pack stream"
        )
    if cfg.packs_documents and cfg.hf_config:
        from fastpar.models.hf import check_documents, load_config

        try:
            check_documents(load_config(cfg.hf_config))
        except ValueError as exc:
            raise ValueError(f"--pack documents with --hf-config {cfg.hf_config}: {exc}") from exc
    if (
        cfg.sequence_parallel
        and cfg.tp > 1
        and not SCHEDULES[cfg.schedule].accepts("sequence_parallel_tp")
    ):
        raise ValueError(schedule_refusal(cfg, "sequence_parallel_tp", SCHEDULES[cfg.schedule]))


def schedule_refusal(cfg, feature: str, sched) -> str:
    """The message refusing ``cfg``'s --schedule with ``feature`` (``Schedule.refuses``): the
    schedule's reason, and what to use instead."""
    why, head = sched.refuses[feature], f"--schedule {cfg.schedule} with"
    if feature == "selective_recompute":
        return (
            f"{head} a selective --recompute ({cfg.recompute}): {why}; use --recompute full "
            "(the stage recomputed once, before its backward) or none"
        )
    if feature == "zero3":
        return (
            f"{head} --zero 3 is not supported ({why}); use --zero 0, 1 or 2, or --schedule "
            f"{accepting('zero3')}"
        )
    if feature == "hf_config":
        return f"{head} --hf-config is {why}; use --schedule {accepting('hf_config')}"
    if feature == "fused_ce":
        return (
            f"{head} --fused-ce at --pp > 1: {why}; use --schedule {accepting('fused_ce')}, or "
            "drop --fused-ce"
        )
    return (
        f"{head} --sequence-parallel at --tp > 1 {why}; use --schedule "
        f"{accepting('sequence_parallel_tp')}, or drop --sequence-parallel"
    )


def check_context_parallel(cfg) -> None:
    """Context parallelism: the sequence splits into 2·cp equal chunks, each rank's pair of
    chunks again over TP under sequence parallelism."""
    if cfg.cp == 1:
        return
    if cfg.cp_attention == "all-to-all" and (cfg.heads // cfg.tp) % cfg.cp:
        raise ValueError(
            f"--cp-attention all-to-all scatters this rank's {cfg.heads // cfg.tp} query heads "
            f"(--heads {cfg.heads} / --tp {cfg.tp}) over --cp {cfg.cp}: they must divide by it; "
            "use --cp-attention ring"
        )
    if cfg.seq_len % (2 * cfg.cp):
        raise ValueError(
            f"--cp {cfg.cp} splits each sequence into 2*cp = {2 * cfg.cp} equal chunks: "
            f"--seq-len {cfg.seq_len} is not divisible by {2 * cfg.cp}"
        )
    if cfg.moe_every and cfg.capacity_factor is not None:
        raise ValueError(
            f"--cp {cfg.cp} with --capacity-factor {cfg.capacity_factor}: each rank routes its "
            "chunks of the sequence, so a capacity would drop per chunk (other tokens than the "
            "single-process model); leave --capacity-factor out (dropless)"
        )
    local = cfg.seq_len // cfg.cp
    if cfg.sequence_parallel and cfg.tp > 1 and local % cfg.tp:
        raise ValueError(
            f"--sequence-parallel with --cp {cfg.cp}: this rank's {local} tokens do not split "
            f"over tp {cfg.tp}; use a --seq-len that is a multiple of {cfg.cp * cfg.tp * 2}"
        )


def check_optimizer(cfg) -> None:
    """--optimizer and --optimizer-state-dtype name what is built (``OptimizerConfig``'s words;
    the rest is refused, never quietly replaced by AdamW in fp32): AdamW, its moments in fp32 or
    bf16; Muon, in fp32."""
    OptimizerConfig(name=cfg.optimizer, state_dtype=cfg.optimizer_state_dtype)
    if cfg.optimizer == "muon" and cfg.optimizer_state_dtype != "fp32":
        raise ValueError(
            f"--optimizer muon --optimizer-state-dtype {cfg.optimizer_state_dtype}: Muon keeps "
            "its momentum (and its AdamW part's moments) in fp32; drop --optimizer-state-dtype, "
            "or use --optimizer adamw for bf16 moments"
        )
