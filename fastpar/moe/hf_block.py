"""``HFMoEBlock``: fastpar's ``MoE`` in a Hugging Face MoE block's place, keeping the block's
parameter names and layouts, so a model converted in place still saves and loads as the HF model.

    model.model.layers[3].mlp = HFMoEBlock(model.model.layers[3].mlp, mesh=mesh)

Its parameters and how they shard: docs/moe.md ("Hugging Face MoE blocks")."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_expert, mark_sharded
from fastpar.moe import experts
from fastpar.moe.hf import block_adapter, hf_family, moe_from_hf
from fastpar.moe.layer import MoE


class _Gate(nn.Module):
    """HF's ``gate``: the router weight, DeepSeek-V3's correction bias, and what
    ``update_expert_bias`` reads (``expert_bias``, ``tokens_per_expert``, ``num_experts``,
    ``bias_update_rate``, ``token_group``)."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        router = moe.router
        self.weight = router.weight
        self.num_experts, self.bias_update_rate = router.num_experts, router.bias_update_rate
        self.token_group = None
        if router.expert_bias is not None:
            self.register_buffer("e_score_correction_bias", router.expert_bias)
            self.register_buffer("tokens_per_expert", router.tokens_per_expert, persistent=False)

    @property
    def expert_bias(self) -> torch.Tensor | None:
        return self._buffers.get("e_score_correction_bias")


class _Experts(nn.Module):
    """HF's fused ``experts``: ``gate_up_proj`` [E_local, 2F/t, H], ``down_proj`` [E_local, H,
    F/t]."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        gate_up, down = experts.to_hf(moe.w1.detach(), moe.w2.detach())
        self.gate_up_proj = nn.Parameter(gate_up.contiguous())
        self.down_proj = nn.Parameter(down.contiguous())
        ep_group = moe.ep_group if moe.ep > 1 else None
        for p in (self.gate_up_proj, self.down_proj):
            mark_expert(p, ep_group, moe.num_experts)
        if moe.tp_layout == "expert_tp":
            f = moe.ffn_hidden_size
            mark_sharded(self.gate_up_proj, 1, moe.tp_group, 2 * f, fused=2)
            mark_sharded(self.down_proj, 2, moe.tp_group, f)


class HFMoEBlock(nn.Module):
    """An HF Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3 MoE block computed by fastpar's
    ``MoE``, under the block's own names (docs/moe.md). ``mesh``: experts over its EP
    group, and over its TP group with ``expert_tp``; ``options`` go to ``moe_from_hf``."""

    def __init__(
        self,
        block: nn.Module,
        *,
        mesh: ParallelMesh | DeviceMesh | None = None,
        expert_tp: bool = True,
        **options,
    ) -> None:
        super().__init__()
        self.family = hf_family(block)
        adapter = block_adapter(block)
        self._shared = (adapter.shared, adapter.shared_gate)
        moe = moe_from_hf(block, mesh=mesh, expert_tp=expert_tp, **options)
        self.gate = _Gate(moe)
        self.experts = _Experts(moe)
        for name in self._shared:  # HF's own modules, shared with the block
            if name is not None:
                setattr(self, name, getattr(block, name))
        moe.shared = moe.shared_gate = None
        for name in ("w1", "w2"):  # views of the HF-layout parameters, taken per forward
            del moe._parameters[name]
        object.__setattr__(self, "moe", moe)  # not a child: its tensors are the ones above
        self.train(block.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        moe.train(self.training)
        moe.router._parameters["weight"] = self.gate.weight
        if self.gate.expert_bias is not None:
            moe.router._buffers["expert_bias"] = self.gate.expert_bias
            moe.router._buffers["tokens_per_expert"] = self.gate.tokens_per_expert
        moe.w1, moe.w2 = experts.from_hf(self.experts.gate_up_proj, self.experts.down_proj)
        y = moe(x)
        shared, gate = self._shared
        if shared is not None:
            out = getattr(self, shared)(x)
            if gate is not None:
                out = torch.sigmoid(getattr(self, gate)(x)) * out
            y = y + out
        return y

    def extra_repr(self) -> str:
        m = self.moe
        return f"{self.family}: experts={m.num_experts} ({m.num_local} local), tp={m.tp_layout}"
