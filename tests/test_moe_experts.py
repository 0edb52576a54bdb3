"""The MoE expert kinds (``expert="mlp" | "glu"``, the activation by name, with or without
biases) and shared experts (always on, optionally sigmoid-gated as in Qwen2-MoE):

- each kind against a per-token float64 reference written here (explicit loops over tokens and
  their chosen experts, activations from their formulas): output and every gradient (input,
  router, experts, shared expert and its gate), capacity (batched experts) and dropless
  (segments);
- the same layer at EP 2 (gloo ranks) against the single-process layer holding every expert;
- shared experts with and without the gate against a hand-written dense reference;
- compile (one graph) equal to eager for a GeGLU expert with biases and a gated shared expert;
- a Hugging Face ``Qwen2MoeSparseMoeBlock`` (random init) copied into ``MoE`` through the
  documented mapping (``fastpar.moe.experts.from_hf``): outputs and gradients in fp32.

Tolerances. The float64 comparisons (the per-token reference, EP 2 against one process) allow
1e-10: float64 rounds ~1e-16 on any machine, a defect moves values of order 1. The router's
weight is fp32 even in a float64 layer, so its gradient is rounded to fp32 once (2^-24
relative). The fp32 comparisons (compiled against eager, fastpar against HF) are judged by
``fastpar.tolerance``'s rule (docs/tolerances.md): the error against the same math in float64
at most 4 x the single-process fp32 run's own (it and its twin one rounding away) plus a floor.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from _mesh import make_mesh
from _parity import agree, exact_copy

from fastpar.mesh import placement
from fastpar.moe import MoE, experts
from fastpar.testing import nudge, run_ranks

H, FFN, E, K, SHARED = 8, 6, 4, 2, 5
F64 = torch.float64

KINDS = {  # name: (expert, activation, bias)
    "mlp-gelu-bias": ("mlp", "gelu", True),
    "mlp-relu": ("mlp", "relu", False),
    "glu-silu": ("glu", "silu", False),
    "glu-silu-bias": ("glu", "silu", True),
    "glu-gelu": ("glu", "gelu", False),
    "glu-gelu_tanh-bias": ("glu", "gelu_tanh", True),
}


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    """Activations from their formulas (not torch.nn.functional)."""
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if name == "silu":
        return x / (1 + torch.exp(-x))
    assert name == "relu"
    return torch.where(x > 0, x, torch.zeros_like(x))


def _ffn(w1, b1, w2, b2, x, gated: bool, act: str) -> torch.Tensor:
    """One FFN on one token x [H] from nn.Linear-layout weights w1 [W, H], w2 [H, F]."""
    h = w1 @ x + (b1 if b1 is not None else 0)
    if gated:
        f = h.shape[0] // 2
        a = _act(act, h[:f]) * h[f:]
    else:
        a = _act(act, h)
    return w2 @ a + (b2 if b2 is not None else 0)


def reference(x: torch.Tensor, p: dict, gated: bool, act: str, top_k: int) -> torch.Tensor:
    """y [T, H]: softmax router, top-k renormalised (k > 1), no drops; plus the shared expert
    (``p["s_w1"]``...) scaled by sigmoid(gate · x) when ``p["gate"]``."""
    rows = []
    for i in range(x.shape[0]):
        t = x[i]
        logits = p["router"] @ t
        probs = torch.exp(logits - logits.max())
        probs = probs / probs.sum()
        ids = sorted(range(E), key=lambda e: -float(probs[e].detach()))[:top_k]
        total = sum(probs[e] for e in ids)
        row = t.new_zeros(H)
        for e in ids:
            w = probs[e] / total if top_k > 1 else probs[e]
            b1, b2 = (p["b1"][e], p["b2"][e]) if "b1" in p else (None, None)
            row = row + w * _ffn(p["w1"][e], b1, p["w2"][e], b2, t, gated, act)
        if "s_w1" in p:
            s = _ffn(p["s_w1"], p.get("s_b1"), p["s_w2"], p.get("s_b2"), t, gated, act)
            if "gate" in p:
                s = s / (1 + torch.exp(-(p["gate"][0] @ t)))
            row = row + s
        rows.append(row)
    return torch.stack(rows)


# layer parameter name -> (reference name, layer -> reference layout, and back)
def _t(w):
    return w.transpose(-1, -2)


def _same(w):
    return w


MAP = {
    "router.weight": ("router", _same),
    "w1": ("w1", _t),
    "b1": ("b1", _same),
    "w2": ("w2", _t),
    "b2": ("b2", _same),
    "shared.w1": ("s_w1", _t),
    "shared.b1": ("s_b1", _same),
    "shared.w2": ("s_w2", _t),
    "shared.b2": ("s_b2", _same),
    "shared_gate.weight": ("gate", _same),
}


def _layer(kind, capacity_factor, shared: bool, gate: bool, mesh=None, dtype=F64, chunks=1) -> MoE:
    expert, act, bias = KINDS[kind]
    torch.manual_seed(0)
    return MoE(
        H,
        FFN,
        E,
        K,
        expert=expert,
        activation=act,
        bias=bias,
        capacity_factor=capacity_factor,
        min_capacity=None,
        shared_ffn_hidden_size=SHARED if shared else None,
        shared_gate=gate,
        mesh=mesh,
        dtype=dtype,
        overlap_chunks=chunks,
        aux_loss_in_backward=False,
    )


def _tokens(rank: int, t: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(t, H, dtype=F64, generator=torch.Generator().manual_seed(10 + rank))
    x[: t // 2] += 1.5  # skewed towards some experts
    return x, torch.randn(t, H, dtype=F64, generator=torch.Generator().manual_seed(20 + rank))


def _run(moe: MoE, x: torch.Tensor, g: torch.Tensor):
    """Output, input grad and every parameter grad (by name) of one forward/backward."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return y.detach(), x.grad, grads


def _close(a, b, what, tol=1e-10):
    """Float64 results (a tolerance far above float64's rounding, far below a defect)."""
    torch.testing.assert_close(
        a.to(F64), b.to(F64), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}"
    )


ROUTER_TOL = 2**-23
"""The router's fp32 weight in a float64 layer: its gradient is rounded to fp32 once."""


CASES = [(k, None, k != "mlp-relu", k.startswith("glu-gelu")) for k in KINDS]
CASES += [("mlp-relu", 4.0, False, False), ("glu-gelu_tanh-bias", 4.0, True, False)]


@pytest.mark.parametrize("kind,capacity_factor,shared,gate", CASES)
def test_kind_equals_the_per_token_reference(kind, capacity_factor, shared, gate):
    expert, act, bias = KINDS[kind]
    moe = _layer(kind, capacity_factor, shared, gate)
    names = [n for n, _ in moe.named_parameters()]
    assert ("b1" in names) == bias and ("shared.w1" in names) == shared
    assert ("shared_gate.weight" in names) == gate
    p = {  # the router is kept in fp32 by the layer; the reference runs all in float64
        MAP[n][0]: MAP[n][1](w.detach()).to(F64).requires_grad_() for n, w in moe.named_parameters()
    }
    x, g = _tokens(0)
    y, x_grad, grads = _run(moe, x, g)
    assert int(moe.stats["num_dropped"]) == 0
    xr = x.clone().requires_grad_()
    y_ref = reference(xr, p, expert == "glu", act, K)
    (y_ref * g).sum().backward()
    _close(y, y_ref.detach(), "output")
    _close(x_grad, xr.grad, "input grad")
    for n, got in grads.items():
        ref, to_ref = MAP[n]
        _close(to_ref(got), p[ref].grad, f"grad {n}", ROUTER_TOL if n == "router.weight" else 1e-10)


def _ep2(kind: str, capacity_factor, shared: bool, gate: bool, chunks: int) -> None:
    rank = dist.get_rank()
    full = _layer(kind, capacity_factor, shared, gate)
    moe = _layer(kind, capacity_factor, shared, gate, mesh=make_mesh(ep=2), chunks=chunks)
    lo, n = rank * moe.num_local, moe.num_local
    routed = {"w1", "b1", "w2", "b2"}
    for name, w in moe.named_parameters():
        want = dict(full.named_parameters())[name]
        assert torch.equal(w, want[lo : lo + n] if name in routed else want), name
        assert placement.is_expert(w) == (name in routed), name  # shared: dense
    # the single-process layer on every rank's tokens (dropless: uneven counts per rank;
    # capacity mode needs the same count on every rank)
    counts = (11, 14) if capacity_factor is None else (12, 12)
    ref = [_run(full, *_tokens(r, counts[r])) for r in (0, 1)]
    x, g = _tokens(rank, counts[rank])
    y, x_grad, grads = _run(moe, x, g)
    _close(y, ref[rank][0], "output")
    _close(x_grad, ref[rank][1], "input grad")
    for name, got in grads.items():
        if name in routed:  # an expert's gradient comes from every rank's tokens
            want = (ref[0][2][name] + ref[1][2][name])[lo : lo + n]
        else:  # dense: this rank's tokens (the data-parallel reduction sums the ranks)
            want = ref[rank][2][name]
        _close(got, want, f"grad {name}", ROUTER_TOL if name == "router.weight" else 1e-10)


EP_CASES = [(k, None, True, True, 1) for k in KINDS] + [
    ("mlp-relu", 4.0, False, False, 1),
    ("glu-gelu", 4.0, True, False, 1),
    ("glu-gelu_tanh-bias", None, True, True, 3),  # overlapped in 3 chunks
    ("glu-silu-bias", 4.0, False, False, 3),
]


@pytest.mark.parametrize("kind,capacity_factor,shared,gate,chunks", EP_CASES)
def test_ep2_equals_the_single_process_layer(kind, capacity_factor, shared, gate, chunks):
    run_ranks(_ep2, 2, kind, capacity_factor, shared, gate, chunks)


def test_shared_experts_not_marked_expert():
    moe = _layer("glu-silu", None, True, True)
    marked = {n for n, p in moe.named_parameters() if placement.is_expert(p)}
    assert marked == {"w1", "w2"}


def test_shared_expert_by_hand_with_and_without_gate():
    """Routed experts zeroed, so the output is the shared expert alone: relu MLP with biases,
    x = [1, 2]: x W1 + b1 = [1, -2] + [0, 1] -> relu [1, 0]; W2 -> [2, 0]; + b2 -> [2.5, 0.5];
    the gate's sigmoid(0 · x) = 1/2 halves it."""
    for gate, want in ((False, [2.5, 0.5]), (True, [1.25, 0.25])):
        moe = MoE(
            2,
            3,
            2,
            1,
            expert="mlp",
            activation="relu",
            capacity_factor=None,
            shared_ffn_hidden_size=2,
            shared_gate=gate,
        )
        with torch.no_grad():
            for w in (moe.w2, moe.b2):
                w.zero_()
            moe.shared.w1.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
            moe.shared.b1.copy_(torch.tensor([0.0, 1.0]))
            moe.shared.w2.copy_(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
            moe.shared.b2.copy_(torch.tensor([0.5, 0.5]))
            if gate:
                moe.shared_gate.weight.zero_()
        y = moe(torch.tensor([[1.0, 2.0]]))
        torch.testing.assert_close(y, torch.tensor([want]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("gate", [False, True])
def test_shared_expert_is_added_to_the_unchanged_routed_output(gate):
    """The shared expert is drawn after the routed experts, so a layer with one has the same
    router and experts; its output is theirs plus the shared FFN (gated by sigmoid(x W_g))."""
    x = _tokens(0)[0]
    plain = _layer("glu-gelu", None, False, False)
    moe = _layer("glu-gelu", None, True, gate)
    for name, w in plain.named_parameters():
        assert torch.equal(w, dict(moe.named_parameters())[name]), name
    s = moe.shared
    h = x @ s.w1
    want = plain(x) + (torch.nn.functional.gelu(h[:, :SHARED]) * h[:, SHARED:]) @ s.w2
    if gate:
        want = plain(x) + torch.sigmoid(x @ moe.shared_gate.weight.t()) * (want - plain(x))
    _close(moe(x), want.detach(), "output")


def test_defaults_and_aliases_unchanged():
    """Today's configurations keep their parameters and numbers: "swiglu" is glu + silu +
    no bias, bit for bit; the default is a GELU MLP with biases."""
    torch.manual_seed(0)
    default = MoE(H, FFN, E)
    assert [n for n, _ in default.named_parameters()] == ["w1", "b1", "w2", "b2", "router.weight"]
    assert default.activation == "gelu" and default.bias and not default.gated
    assert default.shared is None and default.shared_gate is None
    x = torch.randn(9, H)
    for kw in (dict(expert="glu"), dict(expert="glu", activation="swish", bias=False)):
        torch.manual_seed(0)
        a = MoE(H, FFN, E, expert="swiglu", capacity_factor=None)
        torch.manual_seed(0)
        b = MoE(H, FFN, E, capacity_factor=None, **kw)
        assert [n for n, _ in b.named_parameters()] == ["w1", "w2", "router.weight"]
        for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), n
        assert torch.equal(a(x), b(x))


def test_expert_option_errors():
    with pytest.raises(ValueError, match="experts have no biases; use expert='glu', bias=True"):
        MoE(8, 8, 4, expert="swiglu", bias=True)
    with pytest.raises(ValueError, match="shared_gate=True needs shared experts"):
        MoE(8, 8, 4, shared_gate=True)
    with pytest.raises(ValueError, match="or 'glu'"):
        MoE(8, 8, 4, expert="geglu")
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(8, 8, 4, expert="glu", activation="tanh")
    assert MoE(8, 8, 4, expert="glu", activation="gelu_pytorch_tanh").activation == "gelu_tanh"


def test_compiled_geglu_with_biases_and_gated_shared_expert_equals_eager():
    """Dropless at EP 1: the grouped-matmul custom ops (traced path) with a gated GeGLU expert
    and biases, and the shared expert, in one graph; agreeing with eager by the rule (AOT
    autograd's backward graph runs other kernels than eager's: not bit for bit), against the
    layer's float64 copy."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    moe = _layer("glu-gelu_tanh-bias", None, True, True, dtype=torch.float32)
    moe.aux_loss_scale = 0.5  # compiled code cannot read the aux_loss_scale(...) context
    moe64 = exact_copy(moe)
    x, g = _tokens(0)
    eager, exact = _run(moe, x.float(), g.float()), _run(moe64, x, g)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe, backend=counter, fullgraph=True)
    got = _run(compiled, x.float(), g.float())
    assert counter.frame_count == 1
    n = max(x.shape[0], H, 2 * FFN)  # the tokens a weight gradient sums over, the widths
    agree(got[0], eager[0], exact[0], "output", length=n)
    agree(got[1], eager[1], exact[1], "input grad", length=n)
    for name, want in eager[2].items():
        agree(got[2]["_orig_mod." + name], want, exact[2][name], f"grad {name}", length=n)
    torch._dynamo.reset()


def _hf_block(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe import modeling_qwen2_moe as q

    if not hasattr(q, "Qwen2MoeSparseMoeBlock"):
        pytest.skip("this transformers has no Qwen2MoeSparseMoeBlock")
    cfg = transformers.Qwen2MoeConfig(
        hidden_size=H,
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=SHARED,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=False,
        hidden_act="silu",
    )
    torch.manual_seed(seed)
    block = q.Qwen2MoeSparseMoeBlock(cfg)
    with torch.no_grad():  # HF leaves the fused experts uninitialised and the router at zero
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    return block


def _from_hf(block, mesh=None) -> MoE:
    """The documented mapping: router = gate.weight; w1, w2 = from_hf(gate_up_proj,
    down_proj); shared.w1 = cat(gate_proj, up_proj).t(), shared.w2 = down_proj.t()."""
    moe = MoE(
        H,
        FFN,
        E,
        K,
        expert="swiglu",
        capacity_factor=None,
        normalize_topk=False,
        shared_ffn_hidden_size=SHARED,
        shared_gate=True,
        mesh=mesh,
        aux_loss=None,
    )
    lo, n = (dist.get_rank() * moe.num_local, moe.num_local) if mesh else (0, E)
    w1, w2 = experts.from_hf(block.experts.gate_up_proj, block.experts.down_proj)
    se = block.shared_expert
    with torch.no_grad():
        moe.router.weight.copy_(block.gate.weight)
        moe.w1.copy_(w1[lo : lo + n])
        moe.w2.copy_(w2[lo : lo + n])
        moe.shared.w1.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]).t())
        moe.shared.w2.copy_(se.down_proj.weight.t())
        moe.shared_gate.weight.copy_(block.shared_expert_gate.weight)
    return moe


HF_GRADS = {  # fastpar parameter -> its gradient from the HF block's, in fastpar's layout
    "router.weight": lambda b: b.gate.weight.grad,
    "w1": lambda b: b.experts.gate_up_proj.grad.transpose(1, 2),
    "w2": lambda b: b.experts.down_proj.grad.transpose(1, 2),
    "shared.w1": lambda b: torch.cat(
        [b.shared_expert.gate_proj.weight.grad, b.shared_expert.up_proj.weight.grad]
    ).t(),
    "shared.w2": lambda b: b.shared_expert.down_proj.weight.grad.t(),
    "shared_gate.weight": lambda b: b.shared_expert_gate.weight.grad,
}


def _hf_runs(block, xs):
    """HF's block on every rank's tokens ``xs`` [(x, g)] (an expert's gradient sums over all of
    them), in fp32, as its twin (weights one rounding away: ``nudge``) and in float64 (the
    exact math): per run, per rank (output, gradients in fastpar's layout)."""
    twin = copy.deepcopy(block)
    nudge(twin, seed=1)
    runs = []
    for b in (block, twin, exact_copy(block)):
        dtype = b.gate.weight.dtype
        per_rank = []
        for x, g in xs:
            b.zero_grad(set_to_none=True)
            y_hf = b(x.to(dtype))
            (y_hf * g.to(dtype)).sum().backward()
            per_rank.append((y_hf.detach(), {k: f(b).clone() for k, f in HF_GRADS.items()}))
        runs.append(per_rank)
    return runs


def _hf_parity(ep: int) -> None:
    """fastpar (fp32, EP ``ep``) against HF's block by the rule: the error against HF in float64
    at most 4 x HF's own fp32 error (it and its twin) plus a floor."""
    rank = dist.get_rank() if ep > 1 else 0
    block = _hf_block()
    moe = _from_hf(block, make_mesh(ep=ep) if ep > 1 else None)
    lo, n = rank * moe.num_local, moe.num_local
    xs = [(x.float().view(1, -1, H), g.float().view(1, -1, H)) for x, g in map(_tokens, range(ep))]
    *singles, exact = _hf_runs(block, xs)
    x, g = xs[rank]
    y = moe(x.clone().requires_grad_())
    (y * g).sum().backward()
    length = max(11 * ep, H, 2 * FFN)  # the tokens an expert's gradient sums over, the widths
    agree(y, [s[rank][0] for s in singles], exact[rank][0], "output vs HF", length=length)
    for k in HF_GRADS:
        got = dict(moe.named_parameters())[k].grad
        routed = k in ("w1", "w2")
        want = [
            sum(r[1][k] for r in run)[lo : lo + n] if routed else run[rank][1][k]
            for run in (*singles, exact)
        ]
        agree(got, want[:-1], want[-1], f"grad {k} vs HF", length=length)


def test_qwen2_moe_block_equals_hf():
    _hf_parity(1)


def test_qwen2_moe_block_equals_hf_at_ep2():
    _hf_block()  # skips here when transformers lacks the block
    run_ranks(_hf_parity, 2, 2)
