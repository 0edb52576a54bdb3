<<<<<<< HEAD
"""The MoE layer's experts: their kinds ("mlp", "glu", "swiglu"), initialisation and math, the
dropless paths (grouped / padded / loop, ``set_segments_impl``), the shared experts, and the
mapping of the expert weights to Hugging Face's fused layout (docs/moe.md, "Experts")."""
=======
"""The MoE layer's experts: their kinds, initialisation and math, the shared (always-on)
experts, and the mapping of the expert weights to Hugging Face's fused layout.

Kinds (``MoE(expert=, activation=, bias=)``), each expert a two-matrix FFN H -> F -> H:

- ``"mlp"``: ``act(x W1 + b1) W2 + b2``; ``activation`` default "gelu", ``bias`` default True
  (the 2021 MoE of GShard / Switch; fastpar's default, unchanged).
- ``"glu"``: gated, ``(act(x W_gate + b_gate) * (x W_up + b_up)) W_down + b_down``;
  ``activation`` default "silu" (SwiGLU; "gelu" / "gelu_tanh": GeGLU), ``bias`` default False.
- ``"swiglu"``: the alias of glu + silu + no biases (Mixtral, Qwen2/3-MoE, DeepSeek experts);
  ``activation`` must be unset or "silu", ``bias`` unset or False.

Activations by name (``ACTIVATIONS``): "gelu" (erf), "gelu_tanh" (the tanh approximation; HF's
"gelu_pytorch_tanh"), "relu", "silu" (HF's "swish" too).

Storage (for ``x @ w``, what the batched and grouped matmuls take without a transpose), per
rank's E_local experts: ``w1`` [E_local, H, F] ("glu": [E_local, H, 2F], columns [0, F) the
gate, [F, 2F) the up projection), ``b1`` [E_local, F or 2F] (gate | up), ``w2`` [E_local, F, H],
``b2`` [E_local, H]; biases absent (None, not in the state dict) when ``bias`` is False.
Hugging Face's fused experts (transformers 5: Mixtral, Qwen2-MoE, Qwen3-MoE
``mlp.experts.gate_up_proj`` [E, 2F, H], gate rows first, then up; ``mlp.experts.down_proj``
[E, H, F]) are these matrices transposed: ``gate_up_proj = w1.transpose(1, 2)``,
``down_proj = w2.transpose(1, 2)``. ``to_hf`` / ``from_hf`` return those views (no copy; a
file format that needs contiguous tensors copies once, as ``fastpar.models.llama_hf`` does).
The storage stays transposed against HF's so existing checkpoints and state dicts keep their
shapes.

Dropless experts (``segments``: rows grouped by expert, ``counts`` rows each) run one of three
paths, chosen for every layer by ``set_segments_impl(impl)`` (it returns the previous choice;
``get_segments_impl()`` reads it):

- ``"auto"`` (default) = ``"grouped"``: two ``fastpar.moe.grouped.grouped_linear`` calls, one
  grouped matmul each (``torch._grouped_mm``; its per-group loop where the dtype or strides do
  not suit it); on a GPU no host sync.
- ``"padded"``: each expert's rows zero-padded to the largest count C, then ``batched`` (one
  ``torch.bmm`` per matrix over [E, C, H]) and the real rows gathered back; any dtype and
  strides, but E · C rows computed (up to E times the work and memory when skewed).
- ``"loop"``: one expert at a time, two matmuls each (the weights split by ``unbind``).

Measured on CPU (fp32, forward + backward, E_local 4-16, H 256/512, F 512/1024, 2k-8k rows,
balanced and skewed counts; ``bench/test_bench_moe_grouped.py``,
``bench/RESULTS.md``): grouped and loop tie (grouped/loop median
0.96, 0.84-1.14; the loop ahead by up to 10 % at some SwiGLU sizes), both 0.5-1.1x the indexed
loop used before; padded about the loop's time when balanced, 1.6-5.7x when skewed. Grouped is
the default everywhere: never far behind, one code path with the GPU and ``torch.compile``.

"padded" and "loop" read ``counts`` on the host (a device sync on a GPU). Under
``torch.compile`` the grouped path is traced whatever the choice (no host reads, one graph).
The paths agree to rounding: the matmuls bit for bit in fp32, the activation to 1 ulp (it runs
over differently sized tensors; ``tests/test_moe_grouped_gemm.py``).

Shared experts (``MoE(shared_ffn_hidden_size=Fs, shared_gate=)``): one dense FFN of the routed
experts' kind, ``Fs`` wide, run on every token and added to the routed output (DeepSeek-V2/V3:
a width of ``moe_intermediate_size · n_shared_experts``, no gate); with ``shared_gate`` its
output is scaled per token by ``sigmoid(x W_g)``, ``W_g`` [1, H] without bias (Qwen2-MoE's
``shared_expert_gate``). Its parameters (``shared.w1`` [H, Fs or 2Fs], ``shared.b1``,
``shared.w2`` [Fs, H], ``shared.b2``, ``shared_gate.weight`` [1, H]) are dense: replicated over
EP and TP, reduced over the data-parallel group like the router, not marked ``expert``. HF
Qwen2-MoE's ``shared_expert.{gate,up,down}_proj.weight`` map to ``shared.w1`` =
cat(gate, up).t() and ``shared.w2`` = down.t().
"""
>>>>>>> results

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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


def _unbind(t: torch.Tensor | None, n: int) -> list[torch.Tensor | None]:
    return [None] * n if t is None else list(t.unbind(0))


def _segments_loop(x, sizes, w1, b1, w2, b2, gated, activation):
    """Expert by expert; the weights split by ``unbind`` (its backward stacks the E gradients
    once, where indexing ``w1[e]`` would build and add E zero-filled [E, ...] gradients)."""
    outs = []
    n = len(sizes)
    per_expert = zip(x.split(sizes), *(_unbind(t, n) for t in (w1, b1, w2, b2)), strict=True)
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
