"""Hugging Face MoE blocks <-> ``fastpar.moe.MoE``: load a transformers block into an
expert-parallel layer with the same outputs and gradients, and export it back with HF's names.

    moe = moe_from_hf(model.model.layers[3].mlp, mesh=mesh)      # this EP rank's experts
    sd = moe_to_hf_state_dict(moe, prefix="model.layers.3.mlp.")  # full, gathered over EP

Supported blocks, the settings they map to, what is refused and the numerics beside HF:
docs/moe.md ("Hugging Face MoE blocks"). transformers is never imported here."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar import families
from fastpar.comm import group_rank, plain
from fastpar.mesh.groups import ParallelMesh
from fastpar.moe import experts, tp
from fastpar.moe.layer import MoE


def block_adapter(block: nn.Module) -> families.MoEBlock | None:
    """The registered adapter (``fastpar.families``) of an HF MoE block, or None."""
    return families.moe_block(type(block))


def adapter_names() -> list[str]:
    """The names of the MoE block adapters (the families ``moe_from_hf`` converts)."""
    return [b.name for b in families.moe_blocks()]


OPTIONS = (
    "aux_loss",
    "aux_loss_coef",
    "z_loss_coef",
    "bias_update_rate",
    "overlap_chunks",
    "expert_tp",
    "tp_group",
)
"""``MoE`` options ``moe_from_hf`` passes on: ones that leave the forward unchanged (the HF
block computes no loss; ``aux_loss`` defaults to None here; ``expert_tp`` / ``tp_group``: the
experts' FFN split over the mesh's TP group, ``fastpar.moe.tp``)."""


def hf_family(block: nn.Module) -> str:
    """The family of an HF MoE block ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3");
    ValueError for any other module."""
    adapter = block_adapter(block)
    if adapter is not None:
        return adapter.name
    classes = sorted(c for b in families.moe_blocks() for c in b.classes)
    raise ValueError(
        f"moe_from_hf supports the Hugging Face blocks {classes}; got "
        f"{type(block).__name__}. Other blocks need their own mapping onto fastpar.nn.MoE"
    )


def _activation(act_fn: nn.Module, where: str) -> str:
    """The fastpar activation computing exactly what ``act_fn`` computes (bit for bit)."""
    grid = torch.linspace(-8.0, 8.0, 4097)
    for name, fn in experts.ACTIVATIONS.items():
        if all(torch.equal(act_fn(g), fn(g)) for g in (grid, grid.double())):
            return name
    raise ValueError(
        f"{where} activation {type(act_fn).__name__} (config hidden_act) is none of fastpar's "
        f"exact activations {sorted(experts.ACTIVATIONS)} (HF names: silu / swish, gelu, "
        f"gelu_pytorch_tanh, relu); approximations such as gelu_new are refused"
    )


def _only_params(module: nn.Module, names: set[str], where: str) -> None:
    got = {n for n, _ in module.named_parameters()}
    if got != names:
        raise ValueError(
            f"{where} has parameters {sorted(got)}; fastpar maps exactly {sorted(names)} "
            f"(no biases): {sorted(got - names) or sorted(names - got)} cannot be represented"
        )


def _mlp_width(mlp: nn.Module, act: str, where: str) -> int:
    """Width of a dense HF SwiGLU MLP (gate_proj / up_proj / down_proj, no biases)."""
    _only_params(mlp, {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}, where)
    if _activation(mlp.act_fn, where) != act:
        raise ValueError(
            f"{where} activation differs from the routed experts' ({act}); fastpar's shared "
            "expert uses the routed experts' activation"
        )
    return mlp.gate_proj.weight.shape[0]


def _settings(block: nn.Module, family: str) -> dict:
    """MoE constructor arguments of ``block`` (validated: refuses what MoE cannot compute), as
    its adapter's record (``fastpar.families.MoEBlock``) says the HF block routes."""
    adapter = _adapter(family)
    gate, ex = block.gate, block.experts
    _only_params(ex, {"gate_up_proj", "down_proj"}, f"{family} experts")
    _only_params(gate, {"weight"}, f"{family} gate")
    e, f2, h = ex.gate_up_proj.shape
    if gate.weight.shape != (e, h) or ex.down_proj.shape != (e, h, f2 // 2):
        raise ValueError(
            f"{family} block shapes disagree: gate.weight {tuple(gate.weight.shape)}, "
            f"gate_up_proj {tuple(ex.gate_up_proj.shape)}, down_proj {tuple(ex.down_proj.shape)}"
        )
    act = _activation(ex.act_fn, f"{family} experts")
    kw = dict(
        hidden_size=h,
        ffn_hidden_size=f2 // 2,
        num_experts=e,
        top_k=int(gate.top_k),
        expert="glu",
        activation=act,
        bias=False,
        capacity_factor=None,
        min_capacity=None,
        aux_loss=None,
    )
    jitter = (getattr(block, "jitter_noise", 0.0) or 0.0) if adapter.jitter else 0.0
    if jitter > 0:
        raise ValueError(
            f"{family} router_jitter_noise={jitter} is not supported: HF multiplies the "
            "experts' input (in place) by the noise too, fastpar's jitter= only the router's; "
            "set router_jitter_noise=0"
        )
    if adapter.score != "softmax":
        kw["score"] = adapter.score
    if adapter.expert_bias:
        kw["expert_bias"] = True
    if adapter.groups:
        kw.update(_groups(gate, e, family))
    normalize = adapter.normalize_topk
    kw["normalize_topk"] = bool(gate.norm_topk_prob) if normalize is None else normalize
    if adapter.scaling:
        kw["scaling_factor"] = float(gate.routed_scaling_factor)
    if adapter.shared is not None:
        name = adapter.shared
        width = _mlp_width(getattr(block, name), act, f"{family} {name}")
        kw["shared_ffn_hidden_size"] = (width or None) if adapter.shared_optional else width
    if adapter.shared_gate is not None:
        name = adapter.shared_gate
        _only_params(getattr(block, name), {"weight"}, f"{family} {name}")
        kw["shared_gate"] = True
    return kw


def _groups(gate: nn.Module, experts: int, family: str) -> dict:
    """The group-limited top-k of an HF router (``gate.num_group`` / ``gate.topk_group``)."""
    if gate.num_group is None or gate.topk_group is None:
        raise ValueError(
            f"{family} n_group={gate.num_group}, topk_group={gate.topk_group}: HF's router "
            "needs both (set n_group=1, topk_group=1 for no group limit)"
        )
    groups, topk_group = int(gate.num_group), int(gate.topk_group)
    if experts % groups or experts // groups < 2:
        raise ValueError(
            f"{family} n_group={groups} must split the {experts} experts into equal groups of "
            f"at least 2 (HF scores a group by its top-2 experts)"
        )
    return dict(num_groups=groups, group_topk=topk_group, group_score_topk=2)


@torch.no_grad()
def moe_from_hf(
    block: nn.Module, *, mesh: ParallelMesh | DeviceMesh | None = None, ep_group=None, **options
) -> MoE:
    """A ``MoE`` computing what the HF ``block`` computes (see the module docstring); with
    ``mesh`` (its EP group) or ``ep_group``, this rank holds its slice of the experts.
    ``options``: any of ``OPTIONS`` (e.g. ``aux_loss="micro_batch"`` to train with fastpar's
    balancing loss); anything else is refused (it would change the forward)."""
    bad = sorted(set(options) - set(OPTIONS))
    if bad:
        raise TypeError(f"moe_from_hf does not take {bad}; it passes on only {list(OPTIONS)}")
    family = hf_family(block)
    kw = {**_settings(block, family), **options}
    ex = block.experts
    device, dtype = ex.gate_up_proj.device, ex.gate_up_proj.dtype
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        moe = MoE(**kw, mesh=mesh, ep_group=ep_group, device=device, dtype=dtype)
    lo = group_rank(moe.ep_group) * moe.num_local if moe.ep > 1 else 0
    sl = slice(lo, lo + moe.num_local)
    w1, w2 = experts.from_hf(ex.gate_up_proj, ex.down_proj)
    w1, w2 = w1[sl], w2[sl]
    if moe.tp_layout == "expert_tp":
        r = group_rank(moe.tp_group)
        w1, w2 = tp.shard_ffn(w1, 2, r, moe.tp, True), tp.shard_ffn(w2, 1, r, moe.tp, False)
    moe.w1.copy_(w1)
    moe.w2.copy_(w2)
    moe.router.weight.copy_(block.gate.weight)
    if _adapter(family).expert_bias:
        moe.router.expert_bias.copy_(block.gate.e_score_correction_bias)
    if moe.shared is not None:
        mlp = getattr(block, _adapter(family).shared)
        moe.shared.w1.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t())
        moe.shared.w2.copy_(mlp.down_proj.weight.t())
    if moe.shared_gate is not None:
        moe.shared_gate.weight.copy_(getattr(block, _adapter(family).shared_gate).weight)
    moe.hf_family = family
    moe.train(block.training)
    return moe


def _family_of(moe: MoE) -> str:
    """The family ``moe_from_hf`` recorded, else the first adapter (by name) whose block holds
    exactly the layer's parameters (``_check_layout``)."""
    family = getattr(moe, "hf_family", None)
    if family is not None:
        return family
    have = _layout(moe)
    for adapter in families.moe_blocks():
        if all(w is None or w == h for w, h in zip(_wanted(adapter), have, strict=True)):
            return adapter.name
    raise ValueError(
        "no registered HF MoE block holds this layer's parameters (shared expert "
        f"{have[0]}, shared gate {have[1]}, expert bias {have[2]}): pass family="
    )


def _adapter(family: str) -> families.MoEBlock:
    adapter = next((b for b in families.moe_blocks() if b.name == family), None)
    if adapter is None:
        raise ValueError(f"family must be one of {adapter_names()}, got {family!r}")
    return adapter


def _wanted(a: families.MoEBlock) -> tuple[bool | None, bool, bool]:
    """(shared expert, shared gate, expert bias) of the adapter's block; None: either."""
    return (
        None if a.shared_optional else a.shared is not None,
        a.shared_gate is not None,
        a.expert_bias,
    )


def _layout(moe: MoE) -> tuple[bool, bool, bool]:
    """(shared expert, shared gate, expert bias) of the layer."""
    return (moe.shared is not None, moe.shared_gate is not None, moe.router.expert_bias is not None)


def _check_layout(moe: MoE, family: str) -> None:
    """The layer holds exactly the parameters the family's block has (nothing dropped)."""
    want, have = _wanted(_adapter(family)), _layout(moe)
    for name, w, h in zip(
        ("shared experts", "shared_gate", "expert_bias"), want, have, strict=True
    ):
        if w is not None and w != h:
            raise ValueError(
                f"a {family} block {'has' if w else 'has no'} {name}; this layer "
                f"{'has' if h else 'has no'} {name}: pass the family that matches the layer"
            )


def _gather(w: torch.Tensor, group, world: int, dim: int = 0, fused: int = 1) -> torch.Tensor:
    """Concatenate ``w`` over ``group`` along ``dim`` (collective); ``fused`` blocks (gate |
    up) are gathered block by block, as ``fastpar.moe.tp.shard_ffn`` split them."""
    group = group.get_group() if isinstance(group, DeviceMesh) else group  # a 1-D mesh: its group
    local = w.movedim(dim, 0).contiguous()
    out = local.new_empty((world * local.shape[0], *local.shape[1:]))
    plain.all_gather_into_tensor(out, local, group=group)
    per = local.shape[0] // fused
    out = out.view(world, fused, per, *local.shape[1:]).transpose(0, 1).reshape(out.shape)
    return out.movedim(0, dim)


@torch.no_grad()
def moe_to_hf_state_dict(
    moe: MoE, *, family: str | None = None, prefix: str = "", gather: bool = True
) -> dict[str, torch.Tensor]:
    """The HF block's state dict (keys with ``prefix``) from ``moe``. ``family``: one of
    ``adapter_names()`` (default: the one ``moe_from_hf`` recorded, else the first by name whose
    block has the layer's parameters: expert bias -> deepseek_v3, gated shared expert ->
    qwen2_moe, none -> mixtral / qwen3_moe names). EP > 1: the experts gathered over the EP
    group (collective), or this rank's slice with ``gather=False``. Experts split over TP
    (``expert_tp``) are always gathered over TP (collective over the TP group)."""
    family = family or _family_of(moe)
    adapter = _adapter(family)
    if not moe.gated or moe.bias:
        raise ValueError(
            "HF MoE blocks have gated experts without biases (expert='swiglu' / 'glu', "
            f"bias=False); this layer has expert={moe.expert!r}, bias={moe.bias}"
        )
    _check_layout(moe, family)
    gate_up, down = experts.to_hf(moe.w1.detach(), moe.w2.detach())
    if moe.tp_layout == "expert_tp":  # always whole over TP: HF's layout has no TP slice
        gate_up = _gather(gate_up, moe.tp_group, moe.tp, dim=1, fused=2)
        down = _gather(down, moe.tp_group, moe.tp, dim=2)
    if moe.ep > 1 and gather:
        gate_up, down = _gather(gate_up, moe.ep_group, moe.ep), _gather(down, moe.ep_group, moe.ep)
    router = moe.router.weight.detach()
    sd = {
        "gate.weight": router if adapter.router_dtype else router.to(moe.w1.dtype),
        "experts.gate_up_proj": gate_up,
        "experts.down_proj": down,
    }
    if adapter.expert_bias:
        sd["gate.e_score_correction_bias"] = moe.router.expert_bias.detach()
    shared = adapter.shared
    if shared is not None:
        if moe.shared is not None:
            w1, w2 = moe.shared.w1.detach(), moe.shared.w2.detach()
        else:  # DeepSeek n_shared_experts = 0: HF holds zero-width projections
            h = moe.hidden_size
            w1, w2 = moe.w1.new_empty(h, 0), moe.w1.new_empty(0, h)
        fs = w2.shape[0]
        sd[f"{shared}.gate_proj.weight"] = w1[:, :fs].t()
        sd[f"{shared}.up_proj.weight"] = w1[:, fs:].t()
        sd[f"{shared}.down_proj.weight"] = w2.t()
    if adapter.shared_gate is not None:
        sd[f"{adapter.shared_gate}.weight"] = moe.shared_gate.weight.detach()
    return {prefix + k: v for k, v in sd.items()}
