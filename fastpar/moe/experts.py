"""The MoE layer's experts: their kinds ("mlp", "glu", "swiglu"), initialisation and math, the
dropless paths (grouped / padded / loop, ``set_segments_impl``), the shared experts, and the
mapping of the expert weights to Hugging Face's fused layout (docs/moe.md, "Experts")."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.mesh.placement import mark_blocks
from fastpar.moe import grouped


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}
ALIASES = {"gelu_pytorch_tanh": "gelu_tanh", "swish": "silu"}
EXPERTS = ("mlp", "swiglu")
"""The two expert names of the first release; "glu" (any gate activation) is accepted too."""
KINDS = ("mlp", "glu", "swiglu")


def resolve(expert: str, activation: str | None, bias: bool | None) -> tuple[bool, str, bool]:
    """(gated, activation, bias) of an expert kind, with the defaults filled in; ValueError for
    what no kind computes."""
    if expert not in KINDS:
        raise ValueError(
            f"expert must be one of {EXPERTS}, got {expert!r}, or 'glu' (a gated expert whose "
            f"gate activation= picks: 'glu' with activation='gelu' is GeGLU)"
        )
    if expert == "swiglu":
        if activation not in (None, "silu"):
            raise ValueError(
                f"expert='swiglu' experts are gated by SiLU; activation={activation!r} does not "
                f"apply to them: drop activation= (or use expert='glu' for a {activation}-gated "
                f"expert, expert='mlp' for a {activation} MLP)"
            )
        if bias:
            raise ValueError(
                "expert='swiglu' experts have no biases; use expert='glu', bias=True for "
                "SwiGLU experts with biases"
            )
    gated = expert != "mlp"
    if activation is None:
        activation = "silu" if gated else "gelu"
    activation = ALIASES.get(activation, activation)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return gated, activation, (not gated) if bias is None else bool(bias)


def init_experts(
    num_experts: int, hidden: int, ffn: int, gated: bool, bias: bool, device, dtype
) -> dict[str, torch.Tensor]:
    """Every expert's weights in nn.Linear's [out, in] layout, drawn expert by expert from the
    current random stream like ``nn.Linear``'s (Kaiming-uniform, biases U(±1/sqrt(in))), per
    expert in the order w1, b1, w2, b2: w1 [E, F or 2F (gate rows, then up rows), H],
    b1 [E, F or 2F], w2 [E, H, F], b2 [E, H] (no b1 / b2 without ``bias``)."""
    width = 2 * ffn if gated else ffn
    shapes = {"w1": (width, hidden), "w2": (hidden, ffn)}
    if bias:
        shapes.update(b1=(width,), b2=(hidden,))
    full = {n: torch.empty(num_experts, *s, device=device, dtype=dtype) for n, s in shapes.items()}
    with torch.no_grad():
        for e in range(num_experts):
            for w, b in (("w1", "b1"), ("w2", "b2")):
                nn.init.kaiming_uniform_(full[w][e], a=math.sqrt(5))
                if b in full:
                    bound = 1 / math.sqrt(full[w].shape[2])
                    nn.init.uniform_(full[b][e], -bound, bound)
    return full


def hidden(h: torch.Tensor, gated: bool, activation: str) -> torch.Tensor:
    """The first matrix's output [..., F or 2F] -> the second's input [..., F]."""
    act = ACTIVATIONS[activation]
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return act(gate) * up
    return act(h)


def _affine_batched(x, w, b):
    return torch.bmm(x, w) if b is None else torch.baddbmm(b.unsqueeze(1), x, w)


def batched(x, w1, b1, w2, b2, gated: bool, activation: str) -> torch.Tensor:
    """x [E, N, H] -> [E, N, H]: expert e on the rows x[e]."""
    return _affine_batched(hidden(_affine_batched(x, w1, b1), gated, activation), w2, b2)


SEGMENTS_IMPLS = ("auto", "grouped", "padded", "loop")
_segments = {"impl": "auto"}


def set_segments_impl(impl: str) -> str:
    """Force the path of the eager dropless experts (``segments``) for every layer; returns
    the previous choice, so ``old = set_segments_impl("padded"); ...; set_segments_impl(old)``
    restores it. One of ``SEGMENTS_IMPLS`` (see docs/moe.md)."""
    if impl not in SEGMENTS_IMPLS:
        raise ValueError(f"segments impl must be one of {SEGMENTS_IMPLS}, got {impl!r}")
    old, _segments["impl"] = _segments["impl"], impl
    return old


def get_segments_impl() -> str:
    """The path ``set_segments_impl`` last chose ("auto" unless forced)."""
    return _segments["impl"]


def _sizes(counts) -> list[int]:
    return counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)


def _segments_grouped(x, counts, w1, b1, w2, b2, gated, activation):
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
    offs = grouped.offsets(counts)
    h = hidden(grouped.grouped_linear(x, w1, b1, offs), gated, activation)
    return grouped.grouped_linear(h, w2, b2, offs)


def _segments_loop(x, sizes, w1, b1, w2, b2, gated, activation):
    """Expert by expert; the weights split by ``unbind`` (its backward stacks the E gradients
    once, where indexing ``w1[e]`` would build and add E zero-filled [E, ...] gradients)."""
    outs = []
    n = len(sizes)
    weights = ([None] * n if t is None else t.unbind(0) for t in (w1, b1, w2, b2))
    per_expert = zip(x.split(sizes), *weights, strict=True)
    for part, a1, c1, a2, c2 in per_expert:
        h = hidden(part @ a1 if c1 is None else part @ a1 + c1, gated, activation)
        outs.append(h @ a2 if c2 is None else h @ a2 + c2)
    return torch.cat(outs) if outs else x


def _segments_padded(x, sizes, w1, b1, w2, b2, gated, activation):
    """Each expert's rows zero-padded to the largest count ``C``: one ``batched`` over
    [E, C, H], the real rows gathered back (padding rows get no gradient)."""
    width = max(sizes, default=0)
    if width == 0:
        return _segments_loop(x, sizes, w1, b1, w2, b2, gated, activation)
    n, experts = x.shape[0], len(sizes)
    counts = torch.tensor(sizes, dtype=torch.int64, device=x.device)
    starts = torch.cumsum(counts, 0) - counts
    base = torch.arange(experts, device=x.device) * width - starts
    dest = torch.arange(n, device=x.device) + base.repeat_interleave(counts, output_size=n)
    xp = x.new_zeros(experts * width, x.shape[1]).index_copy(0, dest, x)
    y = batched(xp.view(experts, width, -1), w1, b1, w2, b2, gated, activation)
    return y.reshape(experts * width, -1).index_select(0, dest)


def segments(x, counts, w1, b1, w2, b2, gated: bool, activation: str) -> torch.Tensor:
    """x [N, H] grouped by expert with ``counts`` [E] (tensor or list) rows each -> [N, H],
    by the path ``set_segments_impl`` chose (docs/moe.md); traced: always grouped."""
    if torch.compiler.is_compiling() or _segments["impl"] in ("auto", "grouped"):
        return _segments_grouped(x, counts, w1, b1, w2, b2, gated, activation)
    run = _segments_padded if _segments["impl"] == "padded" else _segments_loop
    return run(x, _sizes(counts), w1, b1, w2, b2, gated, activation)


class SharedExperts(nn.Module):
    """The always-on dense expert of a MoE layer: the routed experts' kind, ``ffn`` wide,
    ``x [..., H] -> [..., H]``; with ``gate``, scaled by ``sigmoid(x W_g)`` per token
    (``gate`` is then the ``nn.Linear(H, 1, bias=False)`` the owner registers)."""

    def __init__(self, hidden_size, ffn, gated, activation, bias, device=None, dtype=None):
        super().__init__()
        self.gated, self.activation, self.ffn_hidden_size = gated, activation, ffn
        full = init_experts(1, hidden_size, ffn, gated, bias, device, dtype)
        self.w1 = nn.Parameter(full["w1"][0].t().contiguous())
        if gated:  # gate | up: two matrices for Muon
            mark_blocks(self.w1, 1, (ffn, ffn))
        self.b1 = nn.Parameter(full["b1"][0].clone()) if bias else None
        self.w2 = nn.Parameter(full["w2"][0].t().contiguous())
        self.b2 = nn.Parameter(full["b2"][0].clone()) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1 if self.b1 is None else x @ self.w1 + self.b1
        h = hidden(h, self.gated, self.activation)
        return h @ self.w2 if self.b2 is None else h @ self.w2 + self.b2

    def extra_repr(self) -> str:
        return f"ffn={self.ffn_hidden_size}, gated={self.gated}, activation={self.activation}"


def to_hf(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fastpar ``w1`` [E, H, 2F], ``w2`` [E, F, H] -> HF's (``gate_up_proj`` [E, 2F, H],
    ``down_proj`` [E, H, F]): views, no copy (gated experts; a plain MLP's ``w1`` [E, H, F]
    maps the same way to an [E, F, H] up projection)."""
    return w1.transpose(1, 2), w2.transpose(1, 2)


def from_hf(gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
    """HF's (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]) -> fastpar (``w1``
    [E, H, 2F], ``w2`` [E, F, H]): views, no copy (``copy_`` them into the parameters)."""
    return gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)
