"""The tiny model of the training-command tests, defined once: ``tiny_config(**changes)`` gives
the flags by their flat names (``TrainConfig.from_flags``' keywords), ``tiny_argv(**changes)`` the command line of
``python -m fastpar.train`` / ``fastpar.verify`` / ``main(argv)``; ``argv(**options)`` writes
any keywords as flags. A test passes only what it changes (a layout, the steps, a flag)."""

from __future__ import annotations

#: a 2-block GPT of width 32 and 4 heads, 8 sequences of 16 tokens a step, 2 steps, no log lines:
#: it starts in about a second and runs a step in milliseconds
TINY = dict(steps=2, batch_size=8, seq_len=16, hidden=32, heads=4, layers=2, quiet=True)
#: a run of a Hugging Face model (--hf-config, --init-from-hf: its size is its config's)
HF_RUN = dict(steps=2, batch_size=8, seq_len=16, quiet=True)
#: one process, no MoE block (the trainer's defaults are dp x tp 2 x pp 2 with MoE blocks)
ONE_RANK = dict(tp=1, pp=1, dp=1, ep=1, moe_every=0)
#: sigmoid scores over 2 groups of experts (top 1 group), the expert bias: DeepSeek-V3's router
SIGMOID_GROUPS = dict(
    router_score="sigmoid", router_groups=2, router_group_topk=1, expert_bias=True
)
#: DeepSeek-style MoE blocks (test_moe_tp's and the verification matrix's): the sigmoid groups, a
#: scaled and a shared expert, the per-sequence balancing loss and a z-loss
DEEPSEEK_STYLE = dict(
    SIGMOID_GROUPS,
    **dict(routed_scaling_factor=1.5, shared_expert_ffn=16, aux_loss="sequence", z_loss_coef=0.01),
)
#: DeepSeek-V3's routing in small (``model_type="deepseek"``): its router, a scaled and a shared
#: expert, the per-sequence balancing loss; YaRN on
DEEPSEEK = dict(
    SIGMOID_GROUPS,
    **dict(routed_scaling_factor=2.5, shared_expert_ffn=16, moe_ffn=8, aux_loss="sequence"),
    **dict(yarn_factor=2.0, yarn_original_seq_len=8, yarn_mscale_all_dim=1.0),
)


def tiny_config(*bases: dict, **changes) -> dict:
    """``TINY``, then each of ``bases`` (``ONE_RANK``, a layout), then ``changes``: the later
    wins; a value None leaves the field out (its default)."""
    merged = dict(TINY)
    for base in (*bases, changes):
        merged.update(base)
    return {k: v for k, v in merged.items() if v is not None}


def tiny_argv(*bases: dict, **changes) -> list[str]:
    """The command line of ``tiny_config(*bases, **changes)``."""
    return argv(**tiny_config(*bases, **changes))


def argv(**options) -> list[str]:
    """``TrainConfig`` keywords as flags, in their order: ``seq_len=16`` -> ``--seq-len 16``,
    ``model_type`` -> ``--model``, True -> the flag alone, False -> its ``--no-`` form, None ->
    left out."""
    out = []
    for name, value in options.items():
        flag = "--model" if name == "model_type" else "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


#: the fastpar-model size flags: --hf-config refuses them (its config sets the model)
SIZES = ("hidden", "heads", "layers")


def with_hf_config(config: dict, path: str) -> dict:
    """``config`` training the Hugging Face model of the config file ``path``: its fastpar-model
    size flags (``SIZES``) left out."""
    return {**{k: v for k, v in config.items() if k not in SIZES}, "hf_config": str(path)}
