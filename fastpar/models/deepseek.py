"""A DeepSeek-V3-class decoder built only from fastpar layers: multi-head latent attention
(``fastpar.models.mla``) and DeepSeekMoE (the first ``first_k_dense`` blocks dense SwiGLU, the
rest MoE), as pipeline blocks with the same protocol as ``build_llama``.

    blocks = build_deepseek(DeepSeekConfig(...), mesh)   # [Embedding, Block x layers, Head]
    loss = deepseek_loss(logits, targets, cfg, mesh)      # vocab-parallel cross-entropy

Its layers, multi-token prediction and context parallelism: docs/hf.md ("fastpar's
DeepSeek"); HF names both ways: ``fastpar.models.deepseek_hf``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from fastpar.cliutil import option
from fastpar.mesh.groups import ParallelMesh
from fastpar.models.activations import Activations, norm_bytes, swiglu_activations
from fastpar.models.common import DecoderBlock, build_decoder, check_layout, check_sizes, lm_loss
from fastpar.models.llama import MLP, check_routing, moe, sync_routing
from fastpar.models.mla import LatentAttention
from fastpar.models.mtp import add_mtp, check_mtp
from fastpar.models.shape import MODEL, SwiGLUShape
from fastpar.moe.config import ExpertConfig, RouterConfig

__all__ = ["Block", "DeepSeekConfig", "build_deepseek", "deepseek_loss"]


@dataclass(frozen=True)
class DeepSeekConfig(SwiGLUShape):
    """Model shape and options of a DeepSeek-V3-class decoder (HF ``DeepseekV3Config``'s names
    in parentheses). The MoE routing options are ``moe_router`` and ``moe_experts``
    (``fastpar.moe.config``); DeepSeek-V3 itself routes with ``RouterConfig(score="sigmoid",
    expert_bias=True)``, groups and shared experts. ``ffn``: the
    dense blocks' width (None: 8·hidden/3 rounded up to a multiple of 64); ``norm_eps``: the
    block and final norms' (the latent norms, MTP blocks and CP widths: docs/hf.md)."""

    q_lora_rank: int | None = option(
        32,
        MODEL,
        "deepseek: low-rank query's rank (0: one q projection)",
        zero_is_none=True,
        resume="refuse",
    )
    """Rank of the low-rank query (q_a -> RMSNorm -> q_b); None: one q projection."""
    kv_lora_rank: int = option(
        32, MODEL, "deepseek: width of the compressed key/value latent", resume="refuse"
    )
    qk_rope_head_dim: int = option(
        8, MODEL, "deepseek: rotary dims of a query/key head (even)", resume="refuse"
    )
    """Rotary dims of each query / key head (even); the rotary key is shared by all heads."""
    qk_nope_head_dim: int = option(
        16, MODEL, "deepseek: dims without position of a query/key head", resume="refuse"
    )
    v_head_dim: int = option(16, MODEL, "deepseek: width of a value head", resume="refuse")
    rope_interleave: bool = option(True, MODEL, "deepseek: rotary dims paired", resume="warn")
    """The rotary dims pair up interleaved, (x0, x1), (x2, x3), ... (HF rope_interleave,
    DeepSeek's layout); False: halves, as Llama."""
    yarn_factor: float | None = option(None, MODEL, "deepseek: YaRN scaling factor", resume="warn")
    """YaRN context extension (rope_type "yarn"): the factor; None: plain RoPE."""
    yarn_original_seq_len: int | None = option(
        None, MODEL, "deepseek YaRN: pre-training length (default: --seq-len)", resume="warn"
    )
    """YaRN: the pre-training length (original_max_position_embeddings). None: seq_len."""
    yarn_beta_fast: float = option(32.0, MODEL, "deepseek --yarn-factor: beta_fast", resume="warn")
    """YaRN: rotations where extrapolation ends (beta_fast)."""
    yarn_beta_slow: float = option(1.0, MODEL, "deepseek --yarn-factor: beta_slow", resume="warn")
    """YaRN: rotations where interpolation starts (beta_slow)."""
    yarn_mscale: float = option(1.0, MODEL, "deepseek --yarn-factor: mscale", resume="warn")
    """YaRN mscale: cos / sin scale mscale(f, mscale) / mscale(f, mscale_all_dim) when both
    are set."""
    yarn_mscale_all_dim: float = option(
        0.0, MODEL, "deepseek YaRN: mscale_all_dim (squared, scales the softmax)", resume="warn"
    )
    """YaRN mscale_all_dim (0: unset): the softmax scale is multiplied by
    mscale(factor, mscale_all_dim)² (DeepSeek-V3: 1.0)."""
    first_k_dense: int = option(
        1, MODEL, "deepseek: the first K blocks dense, the rest MoE", resume="refuse"
    )
    """The first this-many blocks are dense SwiGLU (first_k_dense_replace)."""
    moe_every: int = 1
    """Block i >= first_k_dense is MoE when i % moe_every == 0 (DeepSeek-V2's moe_layer_freq;
    HF DeepseekV3: 1); 0: no MoE blocks."""
    moe_router: RouterConfig = field(default_factory=RouterConfig)
    """How the MoE blocks route (HF n_group, topk_group, routed_scaling_factor, the
    e_score_correction_bias); ``capacity_factor`` and ``normalize_topk`` follow the model's
    (``fastpar.models.llama.sync_routing``)."""
    moe_experts: ExpertConfig = field(default_factory=lambda: ExpertConfig(expert="swiglu"))
    """The shared experts (HF n_shared_experts x moe_ffn wide); SwiGLU experts, as the Llama's."""

    def __post_init__(self) -> None:
        sync_routing(self, normalize_topk=self.norm_topk_prob, expert="swiglu")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_original_len(self) -> int:
        return self.yarn_original_seq_len or self.seq_len

    def is_moe(self, layer: int) -> bool:
        return self.moe_every > 0 and layer >= self.first_k_dense and layer % self.moe_every == 0

    def activation_bytes(
        self, tp: int = 1, sp: int = 1, size: int = 4, fused_ce: bool = False
    ) -> Activations:
        """Bytes per token each kind of block keeps for backward on one rank
        (``fastpar.models.activations``): per local head the fused attention's q, k, v and output
        (zero-padded to one width when v_head_dim differs from the q/k head; else v a view of kv_b's
        output) and the output projection's input; replicated on every rank the two latent norms'
        saves (kv_a's output holding the rotary key too); SwiGLU's gate|up, SiLU and product."""
        qk, v, nope = self.qk_head_dim, self.v_head_dim, self.qk_nope_head_dim
        width = max(qk, v)
        per_head = 4 * width + v if qk != v else 3 * qk + nope + 2 * v
        latent = norm_bytes("rmsnorm", self.kv_lora_rank, size) / size + self.qk_rope_head_dim
        if self.q_lora_rank is not None:
            latent += norm_bytes("rmsnorm", self.q_lora_rank, size) / size
        attention = self.heads * per_head + tp * latent  # block_bytes divides it by tp
        # stored output gradients: q (or q_b) and kv_b per head; replicated, kv_a's output and
        # the latent norms' (q_a's and its norm's too)
        replicated = self.kv_lora_rank + self.qk_rope_head_dim + self.kv_lora_rank
        if self.q_lora_rank is not None:
            replicated += 2 * self.q_lora_rank
        grads = self.heads * (qk + nope + v) + tp * replicated
        return swiglu_activations(self, tp, sp, size, fused_ce, attention, grads)

    def check(self, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        """Raise ValueError naming the bad value and the fix, before anything is built."""
        sizes = ("vocab_size", "seq_len", "hidden", "heads", "layers", "kv_lora_rank")
        check_sizes(self, (*sizes, "qk_nope_head_dim", "v_head_dim"))
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(
                f"q_lora_rank must be >= 1, or None for a plain q projection, got "
                f"{self.q_lora_rank}"
            )
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and >= 2 (rotary dims "
                f"pair up): use an even --qk-rope-head-dim"
            )
        if self.heads % tp:
            raise ValueError(
                f"heads {self.heads} are not divisible by tp {tp}: every TP rank needs whole "
                f"heads; use a tp that divides {self.heads} or more heads (--heads)"
            )
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        self._check_yarn()
        if self.first_k_dense < 0:
            raise ValueError(f"first_k_dense must be >= 0, got {self.first_k_dense}")
        if self.moe_every < 0:
            raise ValueError(f"moe_every must be >= 0 (0: no MoE blocks), got {self.moe_every}")
        check_mtp(self)
        every = self.layers + self.mtp_depth  # the MTP modules' blocks are layers too
        moe_layers = [i for i in range(every) if self.is_moe(i)]
        if moe_layers and self.moe_ffn_size < 1:
            raise ValueError(f"moe_ffn must be >= 1, got {self.moe_ffn}")
        if moe_layers and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]: use fewer "
                f"experts per token or more experts"
            )
        if len(moe_layers) < every and self.ffn_size % tp:
            raise ValueError(
                f"ffn {self.ffn_size} of the dense blocks is not divisible by tp {tp}; use an "
                f"ffn that is a multiple of {tp}"
            )
        if ep > 1 and self.moe_every and not moe_layers:
            raise ValueError(
                f"ep={ep} needs MoE layers, but first_k_dense {self.first_k_dense} makes all "
                f"{every} blocks dense: lower first_k_dense (--first-k-dense) or use ep 1"
            )
        check_routing(self)
        check_layout(self, tp, pp, ep)

    def _check_yarn(self) -> None:
        f = self.yarn_factor
        if f is None:
            changed = self.yarn_original_seq_len is not None or (
                self.yarn_beta_fast,
                self.yarn_beta_slow,
                self.yarn_mscale,
                self.yarn_mscale_all_dim,
            ) != (32.0, 1.0, 1.0, 0.0)
            if changed:
                raise ValueError(
                    "the yarn_* options need YaRN on: set yarn_factor (--yarn-factor, e.g. 40)"
                )
            return
        if not (math.isfinite(f) and f > 0):
            raise ValueError(f"yarn_factor {f} must be a positive finite number (e.g. 40)")
        if self.yarn_original_seq_len is not None and self.yarn_original_seq_len < 1:
            raise ValueError(
                f"yarn_original_seq_len must be >= 1, got {self.yarn_original_seq_len}"
            )
        for name in ("yarn_beta_fast", "yarn_beta_slow"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} {value} must be a positive finite number")
        for name in ("yarn_mscale", "yarn_mscale_all_dim"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value} must be a finite number >= 0")


class Block(DecoderBlock):
    """Pre-norm DeepSeek block: x + mla(rmsnorm(x)); x + swiglu_or_moe(rmsnorm(x))."""

    def __init__(self, cfg: DeepSeekConfig, layer: int, mesh: ParallelMesh | None = None):
        super().__init__(
            cfg,
            layer,
            mesh,
            attention=LatentAttention,
            mlp=MLP,
            norm={"eps": cfg.norm_eps},
            moe=moe,
        )


def build_deepseek(cfg: DeepSeekConfig, mesh: ParallelMesh | None = None) -> list[nn.Module]:
    """Every block of the model: [Embedding, Block x cfg.layers, Head], drawn in this order from
    the current random stream on every rank (same seed -> same model at any layout); with
    ``mtp_depth`` the head is an ``MTPHead`` whose modules (DeepSeek blocks of layers
    ``layers .. layers + mtp_depth - 1``) are drawn last."""
    blocks = build_decoder(cfg, mesh, Block, eps=cfg.norm_eps)
    return add_mtp(blocks, cfg, mesh, Block)


#: mean vocab-parallel cross-entropy of logits [B·T, vocab / tp] against targets [B, T]
deepseek_loss = lm_loss
