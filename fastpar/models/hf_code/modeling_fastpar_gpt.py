"""A fastpar GPT as a Hugging Face model (``python -m fastpar.export`` writes this file into the
exported directory):

    model = AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)

Self-contained: torch and transformers only, no fastpar. It computes what fastpar's
single-process ``--model gpt`` computes in eval mode: learned positions, pre-norm blocks, RMSNorm
or LayerNorm, fused q|k|v attention, GELU MLPs or dropless MoE blocks with fastpar's routing
options; weights in fastpar's layout. No key/value cache (generation recomputes the prefix);
left-padded rows never attend to padding and their positions start at the first real token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_fastpar_gpt import FastparGPTConfig


class Norm(nn.Module):
    def __init__(self, config: FastparGPTConfig):
        super().__init__()
        self.kind, self.eps = config.norm, config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.n_embd))
        self.bias = nn.Parameter(torch.zeros(config.n_embd)) if self.kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: FastparGPTConfig):
        super().__init__()
        h = config.n_embd
        self.heads, self.head_dim = config.n_head, h // config.n_head
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` [B, 1, T, T] bool (True: attend), or None: causal."""
        b, t, _ = x.shape
        q, k, v = (
            z.view(b, t, self.heads, self.head_dim).transpose(1, 2)
            for z in self.qkv(x).chunk(3, -1)
        )
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: FastparGPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.n_inner)
        self.proj = nn.Linear(config.n_inner, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Router(nn.Module):
    def __init__(self, config: FastparGPTConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.n_embd))
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T, H] -> (expert ids [T, k], combine weights [T, k] in fp32 or wider)."""
        c = self.config
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        logits = F.linear(h, self.weight.to(h.dtype))
        scores = logits.softmax(-1) if c.router_score == "softmax" else logits.sigmoid()
        sel = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.dtype)
        if c.router_groups is not None:
            t, e = sel.shape
            grouped = sel.view(t, c.router_groups, e // c.router_groups)
            best = grouped.topk(c.group_score_topk, dim=-1).values.sum(-1)
            groups = best.topk(c.router_group_topk, dim=-1).indices
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)
            sel = sel.masked_fill(~keep, float("-inf"))
        ids = sel.topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)
        if c.normalize_topk:
            w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
        if c.routed_scaling_factor is not None:
            w = w * c.routed_scaling_factor
        return ids, w


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(hidden, ffn))
        self.b1 = nn.Parameter(torch.zeros(ffn))
        self.w2 = nn.Parameter(torch.zeros(ffn, hidden))
        self.b2 = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2


class MoE(nn.Module):
    def __init__(self, config: FastparGPTConfig):
        super().__init__()
        e, h, f = config.num_experts, config.n_embd, config.moe_inner
        self.router = Router(config)
        self.w1 = nn.Parameter(torch.zeros(e, h, f))
        self.b1 = nn.Parameter(torch.zeros(e, f))
        self.w2 = nn.Parameter(torch.zeros(e, f, h))
        self.b2 = nn.Parameter(torch.zeros(e, h))
        self.shared = self.shared_gate = None
        if config.shared_expert_ffn is not None:
            self.shared = SharedExpert(h, config.shared_expert_ffn)
            if config.shared_expert_gate:
                self.shared_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        ids, weights = self.router(tokens)
        out = torch.zeros(tokens.shape, dtype=weights.dtype, device=x.device)
        for expert in range(self.w1.shape[0]):
            rows, choice = (ids == expert).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = F.gelu(tokens[rows] @ self.w1[expert] + self.b1[expert])
            y = y @ self.w2[expert] + self.b2[expert]
            out.index_add_(0, rows, y.to(out.dtype) * weights[rows, choice, None])
        y = out.to(x.dtype)
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            y = y + shared.to(y.dtype)
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, config: FastparGPTConfig, layer: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = Norm(config), Attention(config), Norm(config)
        sparse = config.moe_every > 0 and (layer + 1) % config.moe_every == 0
        self.mlp = MoE(config) if sparse else MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class FastparGPTModel(nn.Module):
    def __init__(self, config: FastparGPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = Norm(config)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.wpe.num_embeddings:
            raise ValueError(
                f"{t} tokens exceed the model's {self.wpe.num_embeddings} learned positions"
            )
        mask, pos = None, torch.arange(t, device=input_ids.device)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            keep = attention_mask.bool()  # [B, T]
            pos = (keep.long().cumsum(-1) - 1).clamp(min=0)  # each row's own positions
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            eye = torch.eye(t, dtype=torch.bool, device=input_ids.device)
            # a padding query attends to itself only (its output is never used): no empty row
            mask = ((causal & keep[:, None, :]) | eye)[:, None]
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x, mask)
        return self.ln_f(x)


class FastparGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FastparGPTConfig
    base_model_prefix = "transformer"
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}  # noqa: RUF012
    _no_split_modules = ["Block"]  # noqa: RUF012

    def __init__(self, config: FastparGPTConfig):
        super().__init__(config)
        self.transformer = FastparGPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        logits = self.lm_head(self.transformer(input_ids, attention_mask))
        loss = None
        if labels is not None:  # HF's convention: labels are the inputs, shifted here
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)
