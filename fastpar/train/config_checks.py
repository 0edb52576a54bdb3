"""The checks of a run's flags that relate several of them, each a function of the
``TrainConfig`` ``cfg`` named after what it checks, in the order ``TrainConfig.check`` calls them.
Each failure is one ValueError line naming the value and the fix."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from fastpar.data import BIN_DTYPES, bin_dtype, tokenizer_vocab_size
from fastpar.mesh import MeshLayout
from fastpar.mesh.layout import resolve_dp
from fastpar.models import native
from fastpar.moe.config import ROUTING_DEFAULTS
from fastpar.optim.config import OptimizerConfig
from fastpar.parallel.pipeline.schedules import SCHEDULES, accepting, chunked_names, make_schedule
from fastpar.train.checks import flag


def check_outputs(cfg) -> None:
    """--profile-steps, --metrics-file and --tensorboard."""
    if cfg.profile_steps is not None:
        what = f"--profile-steps {cfg.profile_steps!r}"
        if not cfg.profile:
            raise ValueError(f"{what} needs --profile DIR (where the traces go): add it")
        parts = cfg.profile_steps.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{what} must be A:B, two step numbers (e.g. 3:5)")
        first, last = cfg.profile_window
        if not 1 <= first <= last <= cfg.steps:
            raise ValueError(
                f"{what} must satisfy 1 <= A <= B <= --steps {cfg.steps} (steps A to B "
                f"are recorded, both included)"
            )
    if cfg.metrics_file and os.path.isdir(cfg.metrics_file):
        raise ValueError(f"--metrics-file {cfg.metrics_file} is a directory: pass a file")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install fastpar[tensorboard]"
        )


_NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}


def _first_changed(cfg, defaults, names) -> str | None:
    """The first of the flags ``names`` whose value in ``cfg`` is not the one in ``defaults``
    (or None)."""
    now, then = cfg.flags(), defaults.flags()
    return next((n for n in names if now[n] != then[n]), None)


def check_model_flags(cfg) -> None:
    """--plan without --hf-config, another model's flags, a --norm the model has not;
    --hf-config's checks instead."""
    if cfg.plan and not cfg.hf_config:
        raise ValueError(
            f"--plan {cfg.plan} is a tensor-parallel plan for an --hf-config model: add "
            "--hf-config FILE, or drop --plan (fastpar's models have their own)"
        )
    model = native.get(cfg.model_type)  # (a ValueError naming the models)
    defaults = type(cfg)()  # every flag at its default
    if cfg.init_from_hf:
        check_init_from_hf(cfg)
    if cfg.hf_config:
        check_hf_config(cfg, defaults)
        return check_data_flags(cfg)
    norm = cfg.flags()["norm"]
    if norm not in model.norms:
        norms = [m.label for m in native.REGISTRY.values() if norm in m.norms]
        uses = " or ".join(_NORMS.get(n, n) for n in model.norms)
        raise ValueError(
            f"--norm {norm} is a {' and '.join(norms)} option: the {model.label} uses {uses}"
        )
    foreign = [n for n in native.own_flags() if n not in model.flags]  # others' own flags
    name = _first_changed(cfg, defaults, foreign)
    if name is not None:
        takes = [m for m in native.REGISTRY.values() if name in m.flags]
        whose = " and ".join(m.label for m in takes)
        raise ValueError(
            f"{flag(name)} is a {whose} option: add --model "
            + " or --model ".join(m.name for m in takes)
        )
    check_data_flags(cfg)


def check_init_from_hf(cfg) -> None:
    """--init-from-hf DIR: a save_pretrained directory whose config.json is --hf-config's."""
    from fastpar.models.hf import read_config_json

    what = f"--init-from-hf {cfg.init_from_hf}"
    implied = os.path.join(cfg.init_from_hf, "config.json")
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


def check_hf_config(cfg, defaults) -> None:
    """--hf-config: the model is the config's; fastpar-model flags do not apply."""
    from fastpar.models.hf import decoders, has_moe_block, is_masked_lm, load_config, moe_families

    own = (
        "model_type",
        *("hidden", "heads", "layers", "rope_theta", "norm", "experts", "top_k", "ffn"),
        "untied",
        *native.own_flags(),
        *ROUTING_DEFAULTS,
    )
    name = _first_changed(cfg, defaults, own)
    if name is None and cfg.model.moe_every not in (0, defaults.model.moe_every):
        name = "moe_every"  # 0 (no fastpar MoE block) says nothing about the config's
    if name is not None:
        raise ValueError(
            f"{flag(name)} does not apply with --hf-config (the config sets the model)"
        )
    if cfg.model.sequence_parallel:
        raise ValueError("--sequence-parallel is not supported with --hf-config")
    if cfg.fused_ce:
        raise ValueError("--fused-ce needs fastpar's models (--model gpt / llama)")
    if cfg.cp > 1:
        raise ValueError(
            f"--cp {cfg.cp} with --hf-config: a Hugging Face model's own attention sees "
            "only its chunk of the sequence; context parallelism needs fastpar's models "
            "(--model gpt / llama), use --cp 1"
        )
    config = load_config(cfg.hf_config)
    check_tp_plan(cfg, config)
    if cfg.ep > 1 and not has_moe_block(config):
        raise ValueError(
            f"--ep {cfg.ep} with --hf-config: a {config.model_type} model has no MoE block "
            f"whose experts could split over EP (the families with one: "
            f"{', '.join(moe_families())}); use --ep 1"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != config.vocab_size:
        raise ValueError(
            f"--vocab-size {cfg.vocab_size} differs from the config's vocab_size "
            f"{config.vocab_size}: drop --vocab-size"
        )
    if cfg.tokenizer and tokenizer_vocab_size(cfg.tokenizer) > config.vocab_size:
        raise ValueError(
            f"{cfg.tokenizer} has {tokenizer_vocab_size(cfg.tokenizer)} tokens, more than "
            f"the config's vocab_size {config.vocab_size}: use a matching tokenizer"
        )
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and cfg.model.seq_len > limit:
        raise ValueError(f"--seq-len {cfg.model.seq_len} exceeds the config's {limit} positions")
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % cfg.tp:
            raise ValueError(
                f"--tp {cfg.tp} does not divide the config's {key}={heads}: use a TP size "
                f"that divides it"
            )
    if cfg.pp > 1 and (config.model_type not in decoders() or is_masked_lm(config)):
        raise ValueError(
            f"--pp {cfg.pp} with a {config.model_type} model: pipeline stages split the "
            f"decoder families {list(decoders())}; use --pp 1"
        )
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    if cfg.pp > layers + 2:
        raise ValueError(f"--pp {cfg.pp} exceeds the {layers + 2} pipeline blocks of the model")


def check_tp_plan(cfg, config) -> None:
    """--plan FILE: it reads as a plan whose patterns name the model's modules; without
    it, at tp > 1 the family must have a built-in plan."""
    from fastpar.models.hf import check_plan, has_builtin_plan, plan_hint, read_plan

    if cfg.plan:
        check_plan(config, read_plan(cfg.plan), cfg.plan)
    elif not has_builtin_plan(config) and cfg.tp > 1:  # tp 1: nothing to split
        from fastpar.nn.plans import supported

        raise ValueError(
            f"--hf-config {cfg.hf_config}: model_type {config.model_type!r} has no built-in "
            f"tensor-parallel plan (built-in: {supported()}); {plan_hint()}"
        )


def check_data_flags(cfg) -> None:
    """--data-dtype, --vocab-size against the tokenizer, a .bin file's dtype resolved."""
    if cfg.data_dtype is not None and cfg.data_dtype not in BIN_DTYPES:
        raise ValueError(
            f"data_dtype must be one of {sorted(BIN_DTYPES)} (the ids of a .bin file), "
            f"got {cfg.data_dtype!r}"
        )
    if cfg.tokenizer and cfg.vocab_size is not None:
        n = tokenizer_vocab_size(cfg.tokenizer)
        if cfg.vocab_size < n:
            raise ValueError(
                f"--vocab-size {cfg.vocab_size} is smaller than the {n} tokens of "
                f"{cfg.tokenizer}: drop --vocab-size (it follows the tokenizer) or pass "
                f">= {n}"
            )
    if (cfg.data or "").endswith(".bin"):  # resolved here: checkpoints record it
        if not os.path.isfile(cfg.data):  # before its dtype: no file, no dtype to choose
            raise ValueError(f"data file {cfg.data!r} does not exist")
        cfg.data_dtype = bin_dtype(cfg.data_dtype, cfg.vocab, cfg.data)


#: the refusal of --schedule S with a feature it does not take (``Schedule.refuses``), after
#: "--schedule S with": ``why`` the schedule's reason, ``use`` the schedules that take it
REFUSALS = {
    "selective_recompute": "a selective --recompute ({recompute}): {why}; use --recompute full "
    "(the stage recomputed once, before its backward) or none",
    "zero3": "--zero 3 is not supported ({why}); use --zero 0, 1 or 2, or --schedule {use}",
    "hf_config": "--hf-config is {why}; use --schedule {use}",
    "fused_ce": "--fused-ce at --pp > 1: {why}; use --schedule {use}, or drop --fused-ce",
    "sequence_parallel_tp": "--sequence-parallel at --tp > 1 {why}; use --schedule {use}, or "
    "drop --sequence-parallel",
}


def check_schedule(cfg) -> None:
    """--schedule, --virtual-stages, --microbatch-group-size and the evaluation flags."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    v, sched = cfg.virtual_stages, SCHEDULES[cfg.schedule]  # what the schedule takes
    wanted = {
        "selective_recompute": bool(cfg.recompute) and cfg.recompute is not True,
        "zero3": cfg.zero == 3,
        "hf_config": bool(cfg.hf_config),
        "fused_ce": cfg.fused_ce and cfg.pp > 1,
        "sequence_parallel_tp": cfg.model.sequence_parallel and cfg.tp > 1,
    }
    for feature in [f for f, on in wanted.items() if on and not sched.accepts(f)]:
        why, use = sched.refuses[feature], accepting(feature)
        text = REFUSALS[feature].format(recompute=cfg.recompute, why=why, use=use)
        raise ValueError(f"--schedule {cfg.schedule} with {text}")
    if not sched.chunked:
        if v != 1:
            raise ValueError(
                f"--virtual-stages {v} needs --schedule {chunked_names()} (got {cfg.schedule})"
            )
        if cfg.microbatch_group_size is not None:
            raise ValueError(
                f"--microbatch-group-size {cfg.microbatch_group_size} orders the model "
                f"chunks of --schedule {chunked_names()} (got {cfg.schedule}); drop it"
            )
    else:
        if cfg.pp < 2:
            raise ValueError(
                f"--schedule {cfg.schedule} needs --pp 2 or more (model chunks go round "
                "the pipeline ranks); use --schedule 1f1b at --pp 1"
            )
        g = cfg.microbatch_group_size
        if g is None and cfg.microbatches % cfg.pp:
            raise ValueError(
                f"--schedule {cfg.schedule} needs --microbatches ({cfg.microbatches}) to be "
                f"a multiple of --pp {cfg.pp} (micro-batches run in groups of pp); use "
                f"--microbatches {cfg.microbatches + (-cfg.microbatches) % cfg.pp}, or a "
                "--microbatch-group-size whose last group holds at least pp micro-batches"
            )
        if g is not None:
            try:
                make_schedule(cfg.schedule, cfg.microbatches, v, g).check(cfg.pp)
            except ValueError as exc:
                raise ValueError(
                    f"--microbatch-group-size {g} with --microbatches {cfg.microbatches} "
                    f"and --pp {cfg.pp}: {exc}"
                ) from None
        blocks = cfg.model.layers + 2  # embedding, layers, head
        if blocks < cfg.pp * v:
            raise ValueError(
                f"--pp {cfg.pp} x --virtual-stages {v} needs {cfg.pp * v} model chunks of "
                f"at least one block, but the model has {blocks} blocks (embedding, "
                f"{cfg.model.layers} layers, head): use --virtual-stages <= {blocks // cfg.pp} "
                f"or --layers >= {cfg.pp * v - 2}"
            )


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


def check_optimizer(cfg) -> None:
    """--optimizer and --optimizer-state-dtype name what is built (``OptimizerConfig``'s words;
    the rest is refused, never quietly replaced by AdamW in fp32): AdamW, its moments in fp32 or
    bf16; Muon, in fp32."""
    OptimizerConfig(**dataclasses.asdict(cfg.optimizer))  # (lenient where it refused)
    if cfg.optimizer.name == "muon" and cfg.optimizer.state_dtype != "fp32":
        raise ValueError(
            f"--optimizer muon --optimizer-state-dtype {cfg.optimizer.state_dtype}: Muon keeps "
            "its momentum (and its AdamW part's moments) in fp32; drop --optimizer-state-dtype, "
            "or use --optimizer adamw for bf16 moments"
        )


def check_context_parallel(cfg) -> None:
    """Context parallelism: the sequence splits into 2·cp equal chunks, each rank's pair of
    chunks again over TP under sequence parallelism."""
    if cfg.cp == 1:
        return
    if cfg.model.cp_attention == "all-to-all" and (cfg.model.heads // cfg.tp) % cfg.cp:
        raise ValueError(
            f"--cp-attention all-to-all scatters this rank's {cfg.model.heads // cfg.tp} query heads "
            f"(--heads {cfg.model.heads} / --tp {cfg.tp}) over --cp {cfg.cp}: they must divide by it; "
            "use --cp-attention ring"
        )
    if cfg.model.seq_len % (2 * cfg.cp):
        raise ValueError(
            f"--cp {cfg.cp} splits each sequence into 2*cp = {2 * cfg.cp} equal chunks: "
            f"--seq-len {cfg.model.seq_len} is not divisible by {2 * cfg.cp}"
        )
    if cfg.model.moe_every and cfg.model.capacity_factor is not None:
        raise ValueError(
            f"--cp {cfg.cp} with --capacity-factor {cfg.model.capacity_factor}: each rank routes its "
            "chunks of the sequence, so a capacity would drop per chunk (other tokens than the "
            "single-process model); leave --capacity-factor out (dropless)"
        )
    local = cfg.model.seq_len // cfg.cp
    if cfg.model.sequence_parallel and cfg.tp > 1 and local % cfg.tp:
        raise ValueError(
            f"--sequence-parallel with --cp {cfg.cp}: this rank's {local} tokens do not split "
            f"over tp {cfg.tp}; use a --seq-len that is a multiple of {cfg.cp * cfg.tp * 2}"
        )


def check_fused_ce_zero3(cfg) -> None:
    """--fused-ce reads the head's weight after its forward, which ZeRO-3 re-shards."""
    if cfg.fused_ce and cfg.zero == 3:
        raise ValueError(
            "--fused-ce with --zero 3: the loss reads the head's weight after the head's "
            "forward, when ZeRO-3 has re-sharded it; use --zero 0-2 or drop --fused-ce"
        )


def check_packing(cfg) -> None:
    """--pack / --eos-id / --loss-normalization: what packed documents can run exactly."""
    if cfg.loss_normalization not in ("token", "sequence"):
        raise ValueError(
            f"--loss-normalization must be token or sequence, got {cfg.loss_normalization!r}"
        )
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


def check_batch_split(cfg) -> None:
    """--batch-size splits into --dp replicas of --microbatches micro-batches each."""
    if cfg.batch_size % cfg.dp or (cfg.batch_size // cfg.dp) % cfg.microbatches:
        raise ValueError(
            f"batch_size {cfg.batch_size} must split into dp={cfg.dp} replicas of "
            f"{cfg.microbatches} micro-batches each (a multiple of {cfg.dp * cfg.microbatches})"
        )


def check_compile(cfg) -> None:
    """--compile is not proven with --mtp-depth."""
    depth = getattr(cfg.model, "mtp_depth", 0)
    if cfg.compile and depth:
        raise ValueError(
            f"--compile with --mtp-depth {depth}: the MTP head is not proven under "
            "torch.compile yet; drop --compile or --mtp-depth"
        )


def check_words(cfg) -> None:
    """Every flag that takes words (``Option.words``) holds one of them (None: left out), for
    whatever the other checks of ``TrainConfig.check`` do not name with their own fix."""
    for name, opt, value in cfg.flag_items():
        words = tuple(opt.words)
        if words and value is not None and value not in words:
            raise ValueError(f"{flag(name)} {value!r} must be one of {', '.join(map(str, words))}")
