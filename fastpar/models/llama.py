"""A Llama-class decoder (Llama 2/3, Qwen2, Qwen3 shapes) built only from fastpar layers, as
pipeline blocks with the same protocol as ``build_gpt``.

    blocks = build_llama(LlamaConfig(...), mesh)   # [Embedding, Block x layers, Head]
    loss = llama_loss(logits, targets, cfg, mesh)  # vocab-parallel cross-entropy

Its layers, the q|k|v row grouping and the global parameter names: docs/hf.md ("fastpar's
Llama"); HF names both ways: ``fastpar.models.llama_hf``."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.cliutil import option
from fastpar.comm import group_size
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_blocks, mark_heads
from fastpar.models.activations import Activations, swiglu_activations
from fastpar.models.common import (
    DecoderBlock,
    Norm,
    attend,
    build_decoder,
    check_layout,
    check_sizes,
    lm_loss,
    moe_block,
    positions,
)
from fastpar.models.mtp import add_mtp, check_mtp
from fastpar.models.shape import MODEL, SwiGLUShape
from fastpar.moe.config import (
    AUX_LOSS_WORDS,
    ROUTING_DEFAULTS,
    SCORES,
    ExpertConfig,
    RouterConfig,
    flat_routing,
    nested_routing,
)
from fastpar.nn import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "Block",
    "LlamaConfig",
    "build_llama",
    "check_routing",
    "check_routing_values",
    "llama_loss",
    "routed",
    "routing",
    "routing_options",
    "sync_routing",
]


@dataclass(frozen=True)
class LlamaConfig(SwiGLUShape):
    """Model shape and options of a Llama-class decoder: ``SwiGLUShape``'s fields (its
    ``ffn_size``: 8·hidden/3 rounded up to a multiple of 64 where ``ffn`` is None, about the
    parameters of a 4·hidden GELU MLP; MoE blocks where (i + 1) % moe_every == 0, 0-based, HF
    Qwen3-MoE's decoder_sparse_step) and its own below. The MoE routing options are
    ``moe_router`` and ``moe_experts`` (``fastpar.moe.config`` documents their fields)."""

    moe_router: RouterConfig = field(default_factory=RouterConfig)
    """How the MoE blocks route (score, groups, expert bias, balancing losses). Its
    ``capacity_factor`` and ``normalize_topk`` follow the model's ``capacity_factor`` and
    ``norm_topk_prob`` (``sync_routing``)."""
    moe_experts: ExpertConfig = field(default_factory=lambda: ExpertConfig(expert="swiglu"))
    """What the MoE blocks' experts compute beside the routed ones (shared experts); the
    experts are SwiGLU (no biases) whatever ``expert`` says (``sync_routing``)."""

    kv_heads: int | None = option(
        None,
        MODEL,
        help="llama: key/value heads for grouped-query attention (default: --heads)",
        resume="refuse",
    )
    """Key/value heads for grouped-query attention (HF num_key_value_heads); divides heads and
    is divisible by TP. None: heads (multi-head attention)."""
    head_dim: int | None = option(
        None, MODEL, "llama: width of a head (default: hidden / heads)", resume="refuse"
    )
    """Width of one head (even, for RoPE). None: hidden // heads."""
    qk_norm: bool = option(
        False, MODEL, "llama: Qwen3-style RMSNorm on every query and key head", resume="refuse"
    )
    """Qwen3: RMSNorm over head_dim on every query and key head, before RoPE."""
    attention_bias: bool = option(False, MODEL, "llama: Qwen2-style q/k/v bias", resume="refuse")
    """Qwen2: bias on the q, k and v projections (not on the output projection)."""

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    def __post_init__(self) -> None:
        sync_routing(self, normalize_topk=self.norm_topk_prob, expert="swiglu")

    def activation_bytes(
        self, tp: int = 1, sp: int = 1, size: int = 4, fused_ce: bool = False
    ) -> Activations:
        """Bytes per token each kind of block keeps for backward on one rank
        (``fastpar.models.activations``): the rotated q and the output; multi-head: the rotated
        k and the q|k|v buffer (v a view of it), grouped-query: k and v repeated to every query
        head instead; q/k-norms' saves; SwiGLU's gate|up, SiLU and product."""
        q, kv = self.heads * self.head_size, self.num_kv_heads * self.head_size
        attention = 2 * q + (kv + q + 2 * kv if q == kv else 2 * q)
        grads = q + 2 * kv  # (stored output gradients: q|k|v, the q/k-norms' outputs)
        if self.qk_norm:  # a norm over each head's values (its input a copy), per head 1 / rms
            heads = self.heads + self.num_kv_heads
            attention += ((4 + 2 * size) * (q + kv) + 4 * heads) / size
            grads += q + kv
        return swiglu_activations(self, tp, sp, size, fused_ce, attention, grads)

    def check(self, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        """Raise ValueError naming the bad value and the fix, before anything is built."""
        check_sizes(self, ("vocab_size", "seq_len", "hidden", "heads", "layers"))
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"hidden {self.hidden} is not divisible by heads {self.heads}: set head_dim "
                f"(--head-dim) or use a hidden that is a multiple of {self.heads}"
            )
        if self.head_size < 2 or self.head_size % 2:
            raise ValueError(
                f"head_dim {self.head_size} must be even for rotary embeddings: set an even "
                f"head_dim (--head-dim)"
            )
        kv = self.num_kv_heads
        if kv < 1 or self.heads % kv:
            raise ValueError(
                f"kv_heads {kv} must divide heads {self.heads} (each key/value head serves "
                f"heads / kv_heads query heads): use a kv_heads that divides {self.heads}"
            )
        if self.heads % tp:
            raise ValueError(
                f"heads {self.heads} are not divisible by tp {tp}; use a tp that divides {self.heads}"
            )
        if kv % tp:
            raise ValueError(
                f"kv_heads {kv} are not divisible by tp {tp}: every TP rank needs whole key/value "
                f"heads; use a tp that divides {kv} or more kv_heads (--kv-heads)"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.moe_every < 0:
            raise ValueError(f"moe_every must be >= 0 (0: no MoE blocks), got {self.moe_every}")
        if self.moe_every and self.moe_ffn_size < 1:
            raise ValueError(f"moe_ffn must be >= 1, got {self.moe_ffn}")
        if self.moe_every and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]: use fewer "
                f"experts per token or more experts"
            )
        check_routing(self)
        check_mtp(self)
        check_layout(self, tp, pp, ep)


def _named(name: str) -> str:
    """A routing field with its fastpar.train flag: "expert_bias (--expert-bias)"."""
    return f"{name} (--{name.replace('_', '-')})"


def sync_routing(cfg, **follow) -> None:
    """Set the fields of a frozen model config's ``moe_router`` / ``moe_experts`` that follow
    the model's own: the router's ``capacity_factor`` is the model's, and ``follow`` names
    the others (``normalize_topk=``, ``expert="swiglu"``)."""
    follow["capacity_factor"] = cfg.capacity_factor
    for name in ("moe_router", "moe_experts"):
        config = getattr(cfg, name)
        mine = {f.name for f in dataclasses.fields(config)}
        kw = {k: v for k, v in follow.items() if k in mine and getattr(config, k) != v}
        if kw:  # (a copy: the model's own fields are checked where they are declared)
            config = copy.copy(config)
            for k, v in kw.items():
                object.__setattr__(config, k, v)
            object.__setattr__(cfg, name, config)


def routing(cfg) -> dict:
    """A model config's routing options under their flat names (``router_score``,
    ``expert_bias``, ...: ``ROUTING_DEFAULTS``' keys), as the trainer's flags name them."""
    return flat_routing(cfg.moe_router, cfg.moe_experts)


def routed(config: type, **values):
    """``config(**values)`` (a GPT, Llama or DeepSeek config class) where ``values`` may name the
    routing options by their flat names (``router_score="sigmoid"``, ``shared_expert_ffn=16``: the
    trainer's flags), set on the model's own ``moe_router`` / ``moe_experts`` defaults."""
    router, kinds = nested_routing(values)
    own = {k: v for k, v in values.items() if k not in ROUTING_DEFAULTS}
    if router or kinds:
        defaults = config()
        own.setdefault("moe_router", dataclasses.replace(defaults.moe_router, **router))
        own.setdefault("moe_experts", dataclasses.replace(defaults.moe_experts, **kinds))
    return config(**own)


def check_routing(cfg) -> None:
    """The MoE routing options of a GPT, Llama or DeepSeek config (``moe_router``,
    ``moe_experts``): ``check_routing_values`` of their flat names."""
    check_routing_values(routing(cfg), cfg.moe_every, cfg.num_experts, cfg.top_k)


def check_routing_values(values: dict, moe_every: int, num_experts: int, top_k: int) -> None:
    """The MoE routing options by their flat names (``ROUTING_DEFAULTS``' keys): ValueError
    naming the field, its fastpar.train flag and the fix; then whatever ``RouterConfig`` /
    ``ExpertConfig`` refuse. Any of them off its default needs MoE blocks (``moe_every``)."""
    v = values
    if not moe_every:
        changed = [n for n, d in ROUTING_DEFAULTS.items() if v[n] != d]
        if changed:
            raise ValueError(
                f"{_named(changed[0])} = {v[changed[0]]!r} is a MoE routing option "
                f"but the model has no MoE blocks: set moe_every (--moe-every, e.g. 2) or drop it"
            )
        return
    if v["router_score"] not in SCORES:  # the registry itself: a score added there is known
        raise ValueError(
            f"{_named('router_score')} {v['router_score']!r} must be one of {tuple(SCORES)}"
        )
    if v["aux_loss"] is not None and v["aux_loss"] not in AUX_LOSS_WORDS:
        raise ValueError(f"{_named('aux_loss')} {v['aux_loss']!r} must be one of {AUX_LOSS_WORDS}")
    sf = v["routed_scaling_factor"]
    if sf is not None and not (math.isfinite(sf) and sf > 0):
        raise ValueError(
            f"{_named('routed_scaling_factor')} {sf} must be a positive finite number (e.g. 2.5), "
            "or left out (1)"
        )
    for name in ("bias_update_rate", "aux_loss_coef", "z_loss_coef"):
        value, low = v[name], "> 0" if name == "bias_update_rate" else ">= 0"
        if not math.isfinite(value) or value < 0 or (value == 0 and low == "> 0"):
            raise ValueError(f"{_named(name)} {value} must be a finite number {low}")
    if not v["expert_bias"] and v["bias_update_rate"] != ROUTING_DEFAULTS["bias_update_rate"]:
        raise ValueError(
            f"{_named('bias_update_rate')} {v['bias_update_rate']} has no effect without "
            f"expert_bias: add --expert-bias (expert_bias=True) or drop it"
        )
    if v["aux_loss"] in (None, "none") and v["aux_loss_coef"] != ROUTING_DEFAULTS["aux_loss_coef"]:
        raise ValueError(
            f"{_named('aux_loss_coef')} {v['aux_loss_coef']} has no effect with aux_loss none: "
            f"pass --aux-loss micro_batch or sequence, or drop it"
        )
    fs = v["shared_expert_ffn"]
    if fs is not None and fs < 1:
        raise ValueError(f"{_named('shared_expert_ffn')} {fs} must be >= 1")
    if v["shared_expert_gate"] and fs is None:
        raise ValueError(
            f"{_named('shared_expert_gate')} needs a shared expert: set shared_expert_ffn "
            f"(--shared-expert-ffn N, its width)"
        )
    _check_groups(v["router_groups"], v["router_group_topk"], num_experts, top_k)
    router, kinds = nested_routing(v)  # and whatever the dataclasses refuse
    ExpertConfig(**kinds)
    RouterConfig(**router).check(num_experts, top_k)


def _check_groups(groups: int | None, topk: int | None, e: int, top_k: int) -> None:
    if groups is None and topk is None:
        return
    if groups is None:
        raise ValueError(
            f"{_named('router_group_topk')} {topk} needs router_groups (--router-groups N, a "
            f"divisor of the {e} experts)"
        )
    if topk is None:
        raise ValueError(
            f"{_named('router_groups')} {groups} needs router_group_topk (--router-group-topk K: "
            f"the groups each token may route to, 1..{groups})"
        )
    if groups < 1 or e % groups:
        raise ValueError(
            f"{_named('router_groups')} {groups} must divide the {e} experts (--experts) into "
            f"equal groups: use a divisor of {e}"
        )
    if not 1 <= topk <= groups:
        raise ValueError(f"{_named('router_group_topk')} {topk} must be in [1, {groups}]")
    reach = topk * (e // groups)
    if top_k > reach:
        raise ValueError(
            f"top_k {top_k} (--top-k) exceeds the {reach} experts in {topk} groups of "
            f"{e // groups}: raise router_group_topk (--router-group-topk) to "
            f"{math.ceil(top_k / (e // groups))} or lower --top-k"
        )


def routing_options(cfg) -> dict:
    """The MoE keyword arguments of a model config: ``router=cfg.moe_router`` and
    ``experts=cfg.moe_experts``."""
    return dict(router=cfg.moe_router, experts=cfg.moe_experts)


def rope_inv_freq(head_dim: int, theta: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies theta^(-2i / head_dim), as HF computes them (in fp32;
    ``dtype`` float64 for the exact reference)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [-x[d/2:], x[:d/2]] (HF Llama's convention: halves, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, heads split over TP: [B, T(/tp), H] ->
    same. This rank holds heads / tp query heads and kv_heads / tp key/value heads."""

    def __init__(self, cfg: LlamaConfig, group, sp: bool):
        super().__init__()
        tp = group_size(group)
        d, kv = cfg.head_size, cfg.num_kv_heads
        self.head_dim, self.rep = d, cfg.heads // kv
        self.kv_local = kv // tp
        kw = dict(group=group, sequence_parallel=sp, sequence_dim=1)
        # rows grouped by key/value head: [q x rep, k, v] per group (see docs/hf.md)
        self.qkv = ColumnParallelLinear(
            cfg.hidden, (cfg.heads + 2 * kv) * d, bias=cfg.attention_bias, **kw
        )
        # separate matrices for Muon: q, k and v, each the same rows of every kv group
        mark_blocks(self.qkv.weight, 0, (self.rep * d, d, d), kv)
        self.o = RowParallelLinear(cfg.heads * d, cfg.hidden, bias=False, **kw)
        mark_heads(self.qkv.weight, 0, d)  # Muon(per_head=True): every d rows / columns a head
        mark_heads(self.o.weight, 1, d)
        if cfg.qk_norm:  # each rank normalises only its own heads: partial weight gradients
            norm = dict(eps=cfg.norm_eps, group=group, partial_grad=tp > 1)
            self.q_norm, self.k_norm = Norm(d, **norm), Norm(d, **norm)
        else:
            self.q_norm = self.k_norm = None
        # fp32 on the host like HF's (moved once per device; not a buffer, so .to(dtype) keeps it)
        self._inv_freq, self.theta = rope_inv_freq(d, cfg.rope_theta), cfg.rope_theta
        self.cp_group, self.cp_attention = None, "ring"  # the block sets them (cp > 1)

    def rope(self, t: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] of this rank's positions (0..t-1; under context parallelism its
        chunks' global positions), computed in fp32 (float64 for a float64 x), in x's dtype."""
        if self._inv_freq.device != x.device:
            self._inv_freq = self._inv_freq.to(x.device)
        inv_freq = self._inv_freq
        if x.dtype == torch.float64:  # the exact reference: the frequencies in float64 too
            inv_freq = rope_inv_freq(2 * inv_freq.numel(), self.theta, x.dtype).to(x.device)
        pos = positions(t, self.cp_group, x.device).to(inv_freq.dtype)
        freqs = pos[..., None] * inv_freq  # [T, d/2], or [B, T, d/2] inside packed documents
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:  # per row: [B, 1, T, d] against q [B, heads, T, d]
            emb = emb.unsqueeze(1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qkv(x)
        b, t, _ = y.shape
        y = y.view(b, t, self.kv_local, self.rep + 2, self.head_dim)
        q = y[:, :, :, : self.rep].reshape(b, t, self.kv_local * self.rep, self.head_dim)
        k, v = y[:, :, :, self.rep], y[:, :, :, self.rep + 1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, heads, T, d]
        cos, sin = self.rope(t, q)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = attend(
            q, k, v, self.cp_group, self.cp_attention
        )  # GQA: k / v heads serve rep query heads each
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate|up is one ColumnParallelLinear (fused=2)."""

    def __init__(self, cfg: LlamaConfig, group, sp: bool):
        super().__init__()
        kw = dict(group=group, sequence_parallel=sp, sequence_dim=1)
        self.gate_up = ColumnParallelLinear(cfg.hidden, 2 * cfg.ffn_size, bias=False, fused=2, **kw)
        self.down = RowParallelLinear(cfg.ffn_size, cfg.hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def moe(cfg: LlamaConfig, mesh: ParallelMesh | None = None) -> nn.Module:
    """A Llama MoE block: SwiGLU experts (no biases) ``moe_ffn`` wide, the router
    renormalising the top-k weights when ``norm_topk_prob``, with the config's routing options
    (``routing_options``: sigmoid scores, groups, expert bias, shared experts, losses)."""
    return moe_block(cfg, mesh, ffn=cfg.moe_ffn_size, **routing_options(cfg))


class Block(DecoderBlock):
    """Pre-norm Llama block: x + attn(rmsnorm(x)); x + swiglu_or_moe(rmsnorm(x))."""

    def __init__(self, cfg: LlamaConfig, layer: int, mesh: ParallelMesh | None = None):
        super().__init__(
            cfg, layer, mesh, attention=Attention, mlp=MLP, norm={"eps": cfg.norm_eps}, moe=moe
        )


def build_llama(cfg: LlamaConfig, mesh: ParallelMesh | None = None) -> list[nn.Module]:
    """Every block of the model: [Embedding, Block x cfg.layers, Head], drawn in this order from
    the current random stream on every rank (same seed -> same model at any layout); with
    ``mtp_depth`` the head is an ``MTPHead`` whose modules are drawn last."""
    blocks = build_decoder(cfg, mesh, Block, eps=cfg.norm_eps)
    return add_mtp(blocks, cfg, mesh, Block)  # (mtp_depth > 0: the head becomes an MTPHead)


#: mean vocab-parallel cross-entropy of logits [B·T, vocab / tp] against targets [B, T]
llama_loss = lm_loss
