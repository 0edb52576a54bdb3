"""Two small plain-PyTorch transformers (no fastpar inside) for parallelize() tests.

* NanoGPT: fused q|k|v projection ``c_attn``, reshapes with ``self.n_head`` / ``self.n_embd``,
  GELU MLP, tied embedding and LM head.
* Llama: separate q/k/v/o projections with grouped-query attention (``num_heads``,
  ``num_key_value_heads``), reshapes with ``-1`` heads, SwiGLU MLP, RMSNorm, untied head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class NanoAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hd = self.n_embd // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_embd))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = NanoAttention(n_embd, n_head)
        self.mlp = nn.ModuleDict(
            {"c_fc": nn.Linear(n_embd, 4 * n_embd), "c_proj": nn.Linear(4 * n_embd, n_embd)}
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab=101, n_embd=32, n_head=4, n_layer=2, block=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(NanoBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


NANO_PLAN = {
    "wte": "vocab",
    "h.*.attn.c_attn": ("column", {"fused": 3}),
    "h.*.attn.c_proj": "row",
    "h.*.mlp.c_fc": "column",
    "h.*.mlp.c_proj": "row",
    "lm_head": ("column", {"gather_output": True, "pad_output": True}),
}
NANO_HEADS = {"h.*.attn": ["n_embd"]}  # n_head is found by name; n_embd is nanoGPT-specific


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, d: int, num_heads: int, num_key_value_heads: int):
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self.head_dim = d // num_heads
        self.q_proj = nn.Linear(d, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, d, heads, kv_heads, f):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d), RMSNorm(d)
        self.self_attn = LlamaAttention(d, heads, kv_heads)
        self.mlp = LlamaMLP(d, f)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, vocab=96, d=32, heads=8, kv_heads=4, f=48, n_layer=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d, heads, kv_heads, f) for _ in range(n_layer))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


LLAMA_PLAN = {
    "embed_tokens": "vocab",
    "layers.*.self_attn.[qkv]_proj": "column",
    "layers.*.self_attn.o_proj": "row",
    "layers.*.mlp.gate_proj": "column",
    "layers.*.mlp.up_proj": "column",
    "layers.*.mlp.down_proj": "row",
    "lm_head": "column",  # logits stay vocab-parallel: [..., vocab / tp]
}
