"""Multi-head latent attention (MLA, DeepSeek-V2 / V3) built from fastpar layers, with RoPE and
its YaRN scaling as Hugging Face's ``deepseek_v3`` computes them.

    attn = LatentAttention(cfg, group, sp)   # [B, T(/tp), H] -> same

Its projections, how tensor parallelism splits the heads (the rotary key k_pe entering every
local head through ``copy_to_region``) and context parallelism: docs/hf.md ("fastpar's
DeepSeek").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.comm import copy_to_region, gather_from_sequence, group_size
from fastpar.mesh.placement import mark_replicated
from fastpar.models.common import Norm, attend, positions
from fastpar.models.llama import rotate_half
from fastpar.nn import ColumnParallelLinear, RowParallelLinear

__all__ = ["LatentAttention", "yarn_attention_factor", "yarn_inv_freq", "yarn_mscale"]

LATENT_NORM_EPS = 1e-6
"""HF's q_a_layernorm / kv_a_layernorm keep DeepseekV3RMSNorm's default epsilon (not
rms_norm_eps); so do fastpar's latent norms."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 · mscale · ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(cfg) -> float:
    """The factor HF's YaRN multiplies cos and sin by: mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set (non-zero), else mscale(factor)."""
    f = cfg.yarn_factor
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return yarn_mscale(f, cfg.yarn_mscale) / yarn_mscale(f, cfg.yarn_mscale_all_dim)
    return yarn_mscale(f)


def softmax_scale(cfg) -> float:
    """1 / sqrt(qk head dim), times mscale(factor, mscale_all_dim)² under YaRN when
    mscale_all_dim is set (HF's ``yarn_apply_mscale``)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.yarn_factor is not None and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


def yarn_inv_freq(cfg, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rope / 2] inverse frequencies of the rotary dims: theta^(-2i / rope), and under YaRN
    blended with the interpolated ones (divided by factor) by HF's linear ramp between the
    correction dims of beta_fast / beta_slow (truncated to integers)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
    extrapolation = 1.0 / pos_freqs
    if cfg.yarn_factor is None:
        return extrapolation
    factor, original = cfg.yarn_factor, cfg.yarn_original_len
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(dtype)  # the share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def _replicated_linear(n_in: int, n_out: int, group) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    mark_replicated(layer.weight, group)
    return layer


class LatentAttention(nn.Module):
    """Causal multi-head latent attention, heads split over TP (docs/hf.md): [B, T(/tp), H] ->
    same. Parameters (this rank's): ``q`` [heads/tp · (nope + rope), H] or ``q_a``
    [q_lora_rank, H] + ``q_norm`` + ``q_b`` [heads/tp · (nope + rope), q_lora_rank]; ``kv_a``
    [kv_lora_rank + rope, H], ``kv_norm``, ``kv_b`` [heads/tp · (nope + v), kv_lora_rank];
    ``o`` [H, heads/tp · v]. Each rank's rows are whole heads, in HF's order."""

    def __init__(self, cfg, group, sp: bool):
        super().__init__()
        tp = group_size(group)
        self.group, self.sp = group, sp
        self.local = cfg.heads // tp
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        qk = self.nope + self.rope_dim
        h, kw = cfg.hidden, dict(bias=False, group=group)  # the input is whole: no SP inside
        if cfg.q_lora_rank is None:
            self.q = ColumnParallelLinear(h, cfg.heads * qk, **kw)
            self.q_a = self.q_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = _replicated_linear(h, cfg.q_lora_rank, group)
            self.q_norm = Norm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.heads * qk, **kw)
        self.kv_a = _replicated_linear(h, cfg.kv_lora_rank + self.rope_dim, group)
        self.kv_norm = Norm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b = ColumnParallelLinear(
            cfg.kv_lora_rank, cfg.heads * (self.nope + cfg.v_head_dim), **kw
        )
        self.o = RowParallelLinear(
            cfg.heads * cfg.v_head_dim,
            h,
            bias=False,
            group=group,
            sequence_parallel=sp,
            sequence_dim=1,
        )
        # the fused kernels want one head width: q / k and v are zero-padded to the wider
        # (exact: zero columns add nothing to q·k, and v's are cut from the output); SDPA
        # scales by 1 / sqrt(that width), HF by softmax_scale: the difference goes on q
        # (context parallelism passes q, k, v unpadded and the scale to attend: the ring's
        # blocks take their own widths, and padded values would travel around the ring)
        self.width = max(qk, cfg.v_head_dim)
        self.softmax_scale = softmax_scale(cfg)
        self.q_scale = self.softmax_scale * math.sqrt(self.width)
        self.attention_factor = 1.0 if cfg.yarn_factor is None else yarn_attention_factor(cfg)
        self.rope_cfg = cfg  # what yarn_inv_freq reads (float64 runs)
        self._inv_freq = yarn_inv_freq(cfg)  # fp32 on the host like HF's (moved once)
        self.cp_group, self.cp_attention = None, "ring"  # the block sets them (cp > 1)

    def rope(self, t: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope] (or [B, 1, T, rope] inside packed documents) of this rank's
        positions, times YaRN's attention factor, computed in fp32 (float64 for a float64
        ``x``), in x's dtype."""
        if self._inv_freq.device != x.device:
            self._inv_freq = self._inv_freq.to(x.device)
        inv_freq = self._inv_freq
        if x.dtype == torch.float64:  # the exact reference: the frequencies in float64 too
            inv_freq = yarn_inv_freq(self.rope_cfg, x.dtype).to(x.device)
        pos = positions(t, self.cp_group, x.device).to(inv_freq.dtype)
        freqs = pos[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:
            emb = emb.unsqueeze(1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(x.dtype), sin.to(x.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:  # pairs (x0, x1), ... as halves: HF's rope_interleave rotates these
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return x * cos + rotate_half(x) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp:  # the whole sequence, once: backward keeps this rank's chunk
            x = gather_from_sequence(x, self.group, dim=1)
        b, t, _ = x.shape
        q = self.q(x) if self.q is not None else self.q_b(self.q_norm(self.q_a(x)))
        q = q.view(b, t, self.local, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        # k_pe feeds every local head: its gradient is summed over all heads of all ranks
        k_pe = copy_to_region(k_pe, self.group)
        kv = self.kv_b(self.kv_norm(c_kv)).view(b, t, self.local, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        cos, sin = self.rope(t, x)
        q_pe = self._rotate(q_pe, cos, sin)
        k_pe = self._rotate(k_pe.unsqueeze(1), cos, sin)  # [B, 1, T, rope]
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, self.local, -1, -1)), dim=-1)
        if self.cp_group is not None:  # K and V of their own widths around the cp ranks
            out = attend(q, k, v, self.cp_group, self.cp_attention, scale=self.softmax_scale)
            return self.o(out.transpose(1, 2).reshape(b, t, -1))
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k, v = (F.pad(z, (0, self.width - z.shape[-1])) for z in (q, k, v))
        out = attend(q, k, v)[..., : self.v_dim]
        return self.o(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, heads/tp · v] -> H
