"""The options of a MoE layer, each declared once: ``RouterConfig`` (how tokens are routed and
balanced) and ``ExpertConfig`` (what the experts compute), frozen dataclasses validated on
construction; ``SCORES``, the registry of router scores.

    moe = MoE(512, 2048, 8, 2, router=RouterConfig(score="sigmoid", expert_bias=True),
              experts=ExpertConfig(expert="swiglu", shared_ffn_hidden_size=1024))

A field that declares an ``Option`` is also a flag of ``python -m fastpar.train`` under its flat
name (``score`` is ``--router-score``: ``flat_routing`` / ``nested_routing``); the model configs
hold the two as ``moe_router`` and ``moe_experts``.
Capacity and dropping are routing options (the router computes the capacity and picks what an
over-full expert keeps); their flag, --capacity-factor, is the models' own, whose default is
dropless where the layer's is 1.25.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from fastpar.cliutil import flat_name, option, option_of
from fastpar.moe import experts

ROUTING = "MoE routing"
"""The --help section of the routing flags."""


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores normalised to sum 1 over the experts (DeepSeek-V3, Megatron)."""
    return probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)


@dataclass(frozen=True)
class Score:
    """A router score: ``probs(logits [T, E] fp32) -> [T, E]`` and ``balance(probs) -> [T, E]``,
    the per-token distribution the balancing losses average."""

    probs: Callable[[torch.Tensor], torch.Tensor]
    balance: Callable[[torch.Tensor], torch.Tensor]


SCORES: dict[str, Score] = {
    "softmax": Score(lambda logits: torch.softmax(logits, dim=-1), lambda probs: probs),
    "sigmoid": Score(torch.sigmoid, _normalised),
}
"""Router score name -> ``Score``: "softmax" over the experts, "sigmoid" per expert
(DeepSeek-V3). The one list of names: the router, the balancing losses and the flag's words."""

DROP_POLICIES = ("position", "probs", "weights")
DROP_WEIGHTS = ("renormalise", "keep")
AUX_LOSSES = ("micro_batch", "sequence", None)
AUX_LOSS_WORDS = ("micro_batch", "sequence", "none")
"""``AUX_LOSSES`` as the flag's words ("none": None)."""


def score(name: str) -> Score:
    """The ``Score`` named ``name``; ValueError naming it and the allowed names."""
    found = SCORES.get(name)
    if found is None:
        raise ValueError(f"score must be one of {tuple(SCORES)}, got {name!r}")
    return found


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE layer routes and balances (``fastpar.moe.router`` sets these defaults beside
    Megatron-Core's and DeepSeek-V3's). Validated on construction; ``check`` adds what needs
    the number of experts."""

    score: str = option(
        "softmax",
        name="router_score",
        group=ROUTING,
        words=SCORES,
        help="MoE router scores: softmax over the experts, or sigmoid per expert (DeepSeek-V3)",
        resume="warn",
    )
    """How gate logits become expert scores: a name of ``SCORES``."""
    scaling_factor: float | None = option(
        None,
        name="routed_scaling_factor",
        group=ROUTING,
        metavar="F",
        help="MoE: multiply the routed experts' combine weights by this (DeepSeek-V3 "
        "routed_scaling_factor; default 1)",
        resume="warn",
    )
    """Multiplies the combine weights (DeepSeek-V3 routed_scaling_factor; None: 1)."""
    num_groups: int | None = option(
        None,
        name="router_groups",
        group=ROUTING,
        metavar="N",
        help="MoE group-limited routing: split the experts into N equal groups (DeepSeek-V3 "
        "n_group; needs --router-group-topk)",
        resume="warn",
    )
    """Group-limited routing: the experts in this many equal groups (None: off)."""
    group_topk: int | None = option(
        None,
        name="router_group_topk",
        group=ROUTING,
        metavar="K",
        help="MoE group-limited routing: each token routes inside its best K groups "
        "(DeepSeek-V3 topk_group; needs --router-groups)",
        resume="warn",
    )
    """Group-limited routing: each token picks inside its best this-many groups."""
    expert_bias: bool = option(
        False,
        group=ROUTING,
        help="MoE aux-loss-free balancing (DeepSeek-V3): a per-expert bias steers the top-k "
        "choice (not the weights); after every optimizer step it moves by --bias-update-rate "
        "against the load counted over data parallelism (a skipped step moves nothing); saved "
        "in checkpoints",
        resume="refuse",
    )
    """Aux-loss-free balancing: an fp32 ``expert_bias`` buffer [E] steers the choice."""
    bias_update_rate: float = option(
        1e-3, group=ROUTING, help="--expert-bias: the bias step per optimizer step", resume="warn"
    )
    """The expert-bias step: bias += rate · sign(mean load − load) per optimizer step."""
    aux_loss: str | None = option(
        "micro_batch",
        group=ROUTING,
        words=AUX_LOSS_WORDS,
        help="MoE load-balancing loss: micro_batch (Switch, over a micro-batch's tokens), "
        "sequence (DeepSeek-V3's per-sequence loss), none (e.g. with --expert-bias)",
        resume="warn",
    )
    """The load-balancing loss: "micro_batch", "sequence", or None ("none": off)."""
    aux_loss_coef: float = option(
        1e-2, group=ROUTING, help="MoE: the load-balancing loss's coefficient", resume="warn"
    )
    z_loss_coef: float = option(
        0.0,
        group=ROUTING,
        help="MoE: the router z-loss's coefficient (ST-MoE; 0: off)",
        resume="warn",
    )
    normalize_topk: bool | None = None
    """Renormalise the chosen scores to sum 1 (None: when top_k > 1)."""
    group_score_topk: int | None = None
    """Group-limited routing: a group scores the sum of its best this-many (None: 2)."""
    capacity_factor: float | None = 1.25
    """C = ceil(k·T/E·factor) rows per expert (None: dropless)."""
    min_capacity: int | None = 4
    """The least capacity (None / 0: none, as Megatron)."""
    drop_policy: str = "position"
    """Which pairs an over-full expert keeps: a name of ``DROP_POLICIES``."""
    drop_weights: str = "renormalise"
    """After a drop, renormalise the kept choices' weights, or "keep" the pre-drop ones."""
    jitter: float = 0.0
    """Multiplicative input jitter in training (Switch; 0: off)."""

    def __post_init__(self) -> None:
        if self.aux_loss == "none":  # the flag's word for off
            object.__setattr__(self, "aux_loss", None)
        score(self.score)
        cf = self.capacity_factor
        if cf is not None and not cf > 0:
            raise ValueError(f"capacity_factor must be positive or None (dropless), got {cf}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(
                f"drop_policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}"
            )
        if self.drop_weights not in DROP_WEIGHTS:
            raise ValueError(
                f"drop_weights must be one of {DROP_WEIGHTS}, got {self.drop_weights!r}"
            )
        if self.min_capacity is not None and self.min_capacity < 0:
            raise ValueError(
                f"min_capacity must be >= 0 or None (no minimum), got {self.min_capacity}"
            )
        sf = self.scaling_factor
        if sf is not None and not sf > 0:
            raise ValueError(f"scaling_factor must be positive or None, got {sf}")
        if not self.bias_update_rate > 0:
            raise ValueError(f"bias_update_rate must be positive, got {self.bias_update_rate}")
        if self.aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss must be one of {AUX_LOSSES}, got {self.aux_loss!r}")

    def words(self) -> list[str]:
        """The routing in a few words, as a run's header shows it: the score (and scaling),
        the capacity, the balancing loss, then whatever is on of groups, bias, z-loss."""
        scale = f", x{self.scaling_factor:g}" if self.scaling_factor is not None else ""
        cf = self.capacity_factor
        out = [f"{self.score}{scale}", "dropless" if cf is None else f"capacity {cf:g}"]
        aux = self.aux_loss
        out.append(f"aux {aux} {self.aux_loss_coef:g}" if aux is not None else "aux none")
        if self.num_groups:
            out.append(f"group-limited {self.group_topk} of {self.num_groups} groups")
        if self.expert_bias:
            out.append(f"expert bias {self.bias_update_rate:g}")
        if self.z_loss_coef:
            out.append(f"z-loss {self.z_loss_coef:g}")
        return out

    def check(self, num_experts: int, top_k: int) -> int | None:
        """Validates top_k and group-limited routing against ``num_experts``; returns the
        experts summed per group score (None: not group-limited)."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        groups, topk, m = self.num_groups, self.group_topk, self.group_score_topk
        if groups is None and topk is None:
            if m is not None:
                raise ValueError("group_score_topk needs num_groups= and group_topk=")
            return None
        if groups is None or topk is None:
            raise ValueError(
                f"group-limited routing needs both num_groups and group_topk, got "
                f"num_groups={groups}, group_topk={topk}"
            )
        if groups < 1 or num_experts % groups:
            raise ValueError(
                f"num_groups must divide num_experts={num_experts}, got num_groups={groups}"
            )
        per_group = num_experts // groups
        if not 1 <= topk <= groups:
            raise ValueError(f"group_topk must be in [1, num_groups={groups}], got {topk}")
        if top_k > topk * per_group:
            raise ValueError(
                f"top_k={top_k} exceeds the {topk * per_group} experts of {topk} groups "
                f"of {per_group}: raise group_topk"
            )
        m = min(2, per_group) if m is None else m
        if not 1 <= m <= per_group:
            raise ValueError(f"group_score_topk must be in [1, {per_group}], got {m}")
        return m


@dataclass(frozen=True)
class ExpertConfig:
    """What a MoE layer's experts compute (``fastpar.moe.experts`` has the kinds). Validated on
    construction."""

    expert: str = "mlp"
    """The expert kind: "mlp", "glu" or "swiglu" (``fastpar.moe.experts.KINDS``)."""
    activation: str | None = None
    """"gelu", "gelu_tanh", "relu", "silu" (None: GELU for mlp, SiLU for the gated kinds)."""
    bias: bool | None = None
    """Biases on the expert matrices (None: mlp yes, the gated kinds no)."""
    shared_ffn_hidden_size: int | None = option(
        None,
        name="shared_expert_ffn",
        group=ROUTING,
        metavar="N",
        help="MoE: width of a shared expert run on every token beside the routed ones "
        "(DeepSeek / Qwen2-MoE; default: none)",
        resume="refuse",
    )
    """Width of a shared expert of the same kind on every token (None: none)."""
    shared_gate: bool = option(
        False,
        name="shared_expert_gate",
        group=ROUTING,
        help="MoE: scale the shared expert by sigmoid(x W_g) (Qwen2-MoE; needs "
        "--shared-expert-ffn)",
        resume="refuse",
    )

    def words(self) -> list[str]:
        """What is on beside the routed experts, in a few words (a run's header)."""
        if self.shared_ffn_hidden_size is None:
            return []
        gate = ", gated" if self.shared_gate else ""
        return [f"shared expert {self.shared_ffn_hidden_size}{gate}"]

    def __post_init__(self) -> None:
        self.resolved()
        if self.shared_gate and self.shared_ffn_hidden_size is None:
            raise ValueError("shared_gate=True needs shared experts: set shared_ffn_hidden_size")
        fs = self.shared_ffn_hidden_size
        if fs is not None and fs < 1:
            raise ValueError(f"shared_ffn_hidden_size must be >= 1, got {fs}")

    def resolved(self) -> tuple[bool, str, bool]:
        """(gated, activation, bias) with the defaults filled in (``experts.resolve``)."""
        return experts.resolve(self.expert, self.activation, self.bias)


def with_options(
    router: RouterConfig | None, kinds: ExpertConfig | None, options: dict
) -> tuple[RouterConfig, ExpertConfig]:
    """``router`` and ``kinds`` (None: the defaults) with ``options``, their fields by name
    (``score="sigmoid"``, ``expert="swiglu"``), on top; TypeError naming an option that is a
    field of neither."""
    out = []
    for config, given in ((RouterConfig, router), (ExpertConfig, kinds)):
        names = {f.name for f in fields(config)}
        mine = {k: v for k, v in options.items() if k in names}
        base = config() if given is None else given
        out.append(dataclasses.replace(base, **mine) if mine else base)
    known = {f.name for c in (RouterConfig, ExpertConfig) for f in fields(c)}
    unknown = [k for k in options if k not in known]
    if unknown:
        raise TypeError(
            f"unexpected MoE option {unknown[0]!r}: the options are RouterConfig's and "
            f"ExpertConfig's fields ({', '.join(sorted(known))})"
        )
    return out[0], out[1]


FLAT = {
    flat_name(f): (c, f)
    for c in (RouterConfig, ExpertConfig)
    for f in fields(c)
    if option_of(f) is not None
}
"""Flat name (a TrainConfig / model config field) -> (its config class, its field there)."""

ROUTING_DEFAULTS = {flat: f.default for flat, (_, f) in FLAT.items()}
"""Every flat routing field with its default (what a model without MoE blocks must keep)."""


def flat_routing(router: RouterConfig, kinds: ExpertConfig) -> dict:
    """The flagged fields of ``router`` and ``kinds`` under their flat names
    (``{"router_score": router.score, ...}``, ``ROUTING_DEFAULTS``' keys)."""
    by_class = {RouterConfig: router, ExpertConfig: kinds}
    return {flat: getattr(by_class[c], f.name) for flat, (c, f) in FLAT.items()}


def nested_routing(values: dict) -> tuple[dict, dict]:
    """Flat routing values (``ROUTING_DEFAULTS``' keys; any other key ignored) as the keyword
    arguments of ``RouterConfig`` and of ``ExpertConfig``."""
    router: dict = {}
    kinds: dict = {}
    for flat, value in values.items():
        if flat in FLAT:
            config, f = FLAT[flat]
            (router if config is RouterConfig else kinds)[f.name] = value
    return router, kinds
