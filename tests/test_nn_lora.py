"""LoRA on ColumnParallelLinear / RowParallelLinear (``fastpar.nn.lora``) against the
single-process LoRA of the same weights (a plain ``nn.Linear`` base), at TP 1, 2 and 4, with and
without sequence parallelism: the output, the input gradient and every adapter gradient on
every rank (its slice for a split factor; a whole factor's the same bits on every rank), the
base without a gradient; 3 AdamW steps of an MLP's adapters; the effective weight delta; a
planted fault the comparison catches.

The adapters are copies of the same full factors; each rank computes with other shapes (a
slice of B, a partial product, an all-reduce of partial sums) so every quantity is judged by
``fastpar.tolerance``'s rule against the same math in float64 (docs/tolerances.md)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import agree, exact_copy, local_part, same_on_every_rank
from torch import nn

import fastpar.nn.lora as lora_mod
from fastpar.checkpoint.gather import gather_like
from fastpar.nn import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.lora import LoRALinear, apply_lora, lora_parameters
from fastpar.testing import RankError, run_ranks
from fastpar.tolerance import compare, train_references

WORLDS = [1, 2, 4]
S, B_, R, ALPHA = 8, 3, 4, 12.0  # sequence, batch, rank, alpha


def _factors(in_f: int, out_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full A [r, in] and a non-zero B [out, r] (PEFT's zero B would hide B's part of A's
    gradient)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, in_f, generator=g) / in_f**0.5, torch.randn(out_f, R, generator=g) / 2


def _pair(base: nn.Linear, parallel: nn.Module, seed: int):
    """(single-process LoRA, its float64 copy, the parallel LoRA) over the same factors."""
    a, b = _factors(base.in_features, base.out_features, seed)
    ref = LoRALinear(base, R, ALPHA, lora_A=a, lora_B=b)
    return ref, exact_copy(ref), LoRALinear(parallel, R, ALPHA, lora_A=a, lora_B=b)


def _cols(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's output columns (last dim) of ``t``, as the column-split ``p`` holds rows."""
    return local_part(t.transpose(0, -1), p).transpose(0, -1)


def _seq(t: torch.Tensor, sp: bool) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), 0)[dist.get_rank()] if sp else t


def _run(ref, ref64, x: torch.Tensor, gy: torch.Tensor):
    xr, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    yr, y64 = ref(xr), ref64(x64)
    yr.backward(gy)
    y64.backward(gy.double())
    return (yr, xr.grad), (y64, x64.grad)


def _adapters_agree(par, ref, ref64, n: int, what: str, cmp=agree, same=True) -> list:
    """Every adapter gradient of ``par`` against ``ref``'s (sliced like ``par``'s factor), a
    whole factor's gradient the same on every rank, the base without a gradient."""
    out = []
    for name in ("lora_A", "lora_B"):
        p = getattr(par, name)
        full, full64 = getattr(ref, name).grad, getattr(ref64, name).grad
        mine, mine64 = local_part(full, p), local_part(full64, p)  # fused blocks too
        out.append(cmp(p.grad, mine, mine64, f"{what} {name} grad", length=n))
        if same and mine is full:  # whole on every rank: one all-reduce's result
            same_on_every_rank(p.grad, par.group, f"{what} {name} grad")
    assert all(q.grad is None and not q.requires_grad for q in par.base_layer.parameters())
    return out


def _column_case(sp, gather, fused: int, pad, bias, cmp=agree, same=True, dtype=None) -> list:
    in_f, out_f = 22, (21 if pad else 24)
    torch.manual_seed(1)
    base = nn.Linear(in_f, out_f, bias=bias).to(dtype or torch.float32)
    col = ColumnParallelLinear.from_dense(
        base, sequence_parallel=sp, gather_output=gather, fused=fused, pad_output=pad
    )
    ref, ref64, par = _pair(base, col, seed=2)
    g = torch.Generator().manual_seed(3)
    x, gy = torch.randn(S, B_, in_f, generator=g), torch.randn(S, B_, out_f, generator=g)
    x, gy = x.to(base.weight.dtype), gy.to(base.weight.dtype)
    (yr, xgr), (y64, xg64) = _run(ref, ref64, x, gy)
    n = S * B_
    what = f"column(sp={sp}, gather={gather}, fused={fused}, pad={pad}, bias={bias}, {dtype})"
    agree = _in(dtype)
    xp = _seq(x, sp).clone().requires_grad_()
    yp = par(xp)
    local = (lambda t: t) if gather else (lambda t: _cols(t, par.lora_B))
    agree(yp, local(yr), local(y64), f"{what} output", length=in_f)
    yp.backward(local(gy))
    agree(xp.grad, _seq(xgr, sp), _seq(xg64, sp), f"{what} input grad", length=out_f)
    return _adapters_agree(par, ref, ref64, n, what, cmp, same)


def _row_case(sp: bool, parallel_in: bool, bias: bool, cmp=agree, same=True, dtype=None) -> list:
    in_f, out_f = 24, 21
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(4)
    base = nn.Linear(in_f, out_f, bias=bias).to(dtype or torch.float32)
    row = RowParallelLinear.from_dense(base, sequence_parallel=sp, input_is_parallel=parallel_in)
    ref, ref64, par = _pair(base, row, seed=5)
    g = torch.Generator().manual_seed(6)
    x, gy = torch.randn(S, B_, in_f, generator=g), torch.randn(S, B_, out_f, generator=g)
    x, gy = x.to(base.weight.dtype), gy.to(base.weight.dtype)
    (yr, xgr), (y64, xg64) = _run(ref, ref64, x, gy)
    what = f"row(sp={sp}, input_is_parallel={parallel_in}, bias={bias}, {dtype})"
    agree = _in(dtype)
    mine = (lambda t: t.chunk(world, -1)[rank]) if parallel_in else (lambda t: t)
    xp = mine(x).clone().requires_grad_()
    yp = par(xp)
    agree(yp, _seq(yr, sp), _seq(y64, sp), f"{what} output", length=in_f)
    yp.backward(_seq(gy, sp))
    agree(xp.grad, mine(xgr), mine(xg64), f"{what} input grad", length=out_f)
    return _adapters_agree(par, ref, ref64, S * B_, what, cmp, same)


def _in(dtype):
    """``agree`` in the base's working precision (the input, output and their gradients)."""
    return agree if dtype is None else functools.partial(agree, dtype=dtype)


def _layer_cases() -> None:
    for sp in (False, True):
        for gather in (False, True):
            _column_case(sp, gather, fused=1, pad=False, bias=True)
        _column_case(sp, False, fused=3, pad=False, bias=False)  # q|k|v blocks
        _column_case(sp, True, fused=1, pad=True, bias=True)  # padded output rows
        for parallel_in in (True, False):
            _row_case(sp, parallel_in, bias=True)
        _row_case(sp, True, bias=False)


@pytest.mark.parametrize("world", WORLDS)
def test_lora_layers_match_single_process(world):
    run_ranks(_layer_cases, world)


def _bf16_base_cases() -> None:
    for sp in (False, True):
        _column_case(sp, False, fused=1, pad=False, bias=True, dtype=torch.bfloat16)
        _row_case(sp, True, bias=True, dtype=torch.bfloat16)


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_base_fp32_adapters(world):
    """A bf16 base with fp32 adapters (the default on a bf16 base): the input, output and
    input gradient judged in bf16, the fp32 adapters' gradients by the fp32 rule, against the
    single-process LoRA of the same mixed precision and its float64 run."""

    def check():
        torch.manual_seed(0)
        lora = LoRALinear(ColumnParallelLinear(8, 8, dtype=torch.bfloat16), 2, 4.0)
        assert lora.lora_A.dtype == lora.lora_B.dtype == torch.float32
        assert lora.base_layer.weight.dtype == torch.bfloat16
        _bf16_base_cases()

    run_ranks(check, world)


def _skip_whole_factor_reduction(t, group=None):
    """The planted fault: a whole adapter factor (a Parameter) enters without its gradient's
    all-reduce; inputs still do."""
    return t if isinstance(t, nn.Parameter) else _REAL_COPY(t, group)


_REAL_COPY = lora_mod.copy_to_region


def _verdict(actual, single, exact, what, *, length):
    """The rule's verdict, not asserted."""
    return compare(actual, single, exact, what=what, length=length)


def _planted_fault(kind: str, verdicts: bool):
    """The column (or row) case with the fault planted: with ``verdicts`` the rule's verdicts
    on (A, B) with no cross-rank check, else asserted as in the parity test."""
    case = (
        (lambda **k: _column_case(False, False, 1, False, True, **k))
        if kind == "column"
        else (lambda **k: _row_case(False, True, True, **k))
    )
    lora_mod.copy_to_region = _skip_whole_factor_reduction
    try:
        if verdicts:
            return [c.ok for c in case(cmp=_verdict, same=False)]
        case()
    finally:
        lora_mod.copy_to_region = _REAL_COPY


@pytest.mark.parametrize("kind,factor", [("column", "lora_A"), ("row", "lora_B")])
def test_planted_fault_is_caught(kind, factor):
    """Without the all-reduce of the whole factor's gradient (column: A, row: B) each rank
    holds only its part of it: the parity check fails on that factor's gradient, while the
    rule finds the split factor's gradient within its bound."""
    with pytest.raises(RankError, match=f"{factor} grad"):
        run_ranks(_planted_fault, 2, kind, False)
    expected = [False, True] if kind == "column" else [True, False]
    assert run_ranks(_planted_fault, 2, kind, True) == [expected, expected]


def _delta_matches(world: int) -> None:
    for kind, make in (
        ("column", lambda b: ColumnParallelLinear.from_dense(b, fused=2)),
        ("row", RowParallelLinear.from_dense),
    ):
        torch.manual_seed(7)
        base = nn.Linear(24, 20)
        ref, ref64, par = _pair(base, make(base), seed=8)
        got = gather_like({"w": par.delta_weight()}, {"w": par.base_layer.weight})
        merged = gather_like({"w": par.merged_weight()}, {"w": par.base_layer.weight})
        if dist.get_rank() == 0:
            agree(got["w"], ref.delta_weight(), ref64.delta_weight(), f"{kind} delta", length=R)
            agree(merged["w"], ref.merged_weight(), ref64.merged_weight(), kind, length=R)


@pytest.mark.parametrize("world", [1, 2])
def test_delta_weight_gathers_to_single_process(world):
    run_ranks(_delta_matches, world, world)


class _MLP(nn.Module):
    def __init__(self, fc: nn.Module, proj: nn.Module):
        super().__init__()
        self.fc, self.proj = fc, proj

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


H, FF, STEPS, LR = 20, 32, 3, 1e-2


def _with_lora(model: nn.Module) -> nn.Module:
    # A drawn by apply_lora (PEFT's draws); B non-zero from its own generator, so step 1 moves A
    apply_lora(model, "fc,proj", R, ALPHA)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name in ("fc", "proj"):
            m = getattr(model, name)
            full = torch.randn(m.out_features, R, generator=g) / 2
            m.lora_B.copy_(local_part(full, m.lora_B))
    return model


def _dense() -> nn.Module:
    return _with_lora(_MLP(nn.Linear(H, FF), nn.Linear(FF, H)))


def _batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(S, B_, H, generator=g), torch.randn(S, B_, H, generator=g)


def _loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    x, target = _batch(step)
    return F.mse_loss(model(x.to(dtype)), target.to(dtype))


def _training(sp: bool) -> list[float]:
    refs = train_references(_dense, _loss, STEPS, length=S * B_, seed=11, lr=LR, weight_decay=0.01)
    torch.manual_seed(11)
    fc, proj = nn.Linear(H, FF), nn.Linear(FF, H)  # the same draws as _dense's
    par = _with_lora(
        _MLP(
            ColumnParallelLinear.from_dense(fc, sequence_parallel=sp),
            RowParallelLinear.from_dense(proj, sequence_parallel=sp),
        )
    )
    refs.local = lambda t, name: local_part(t, par.get_parameter(name))
    params = dict(lora_parameters(par))
    assert sorted(n for n, p in par.named_parameters() if p.requires_grad) == sorted(params)
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(STEPS):
        x, target = _batch(step)
        y = par(_seq(x, sp))
        part = F.mse_loss(y, _seq(target, sp), reduction="sum") / target.numel()
        loss = part.detach().clone()
        if sp:
            dist.all_reduce(loss)
        opt.zero_grad()
        part.backward()
        for name, p in params.items():
            assert refs.grad(step, name, p.grad).ok, str(refs.grad(step, name, p.grad))
        assert refs.loss(step, float(loss)).ok, str(refs.loss(step, float(loss)))
        losses.append(float(loss))
        opt.step()
    for name, p in params.items():
        assert refs.param(name, p.detach()).ok, str(refs.param(name, p.detach()))
        assert p.grad is not None
    return losses


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("sp", [False, True])
def test_adapters_train_like_single_process(world, sp):
    out = run_ranks(_training, world, sp)
    assert all(losses == out[0] for losses in out)


def _dropout_column(sp: bool) -> None:
    """Dropout 0.25 on a column adapter: ranks that share their random state draw the single
    process's mask (on the whole input; under SP on the gathered one), so the output agrees
    with the single-process LoRA drawn under the same seed."""
    torch.manual_seed(1)
    base = nn.Linear(22, 24)
    a, b = _factors(22, 24, seed=2)
    ref = LoRALinear(base, R, ALPHA, 0.25, lora_A=a, lora_B=b)
    ref64 = exact_copy(ref)
    par = LoRALinear(ColumnParallelLinear.from_dense(base, sequence_parallel=sp), R, ALPHA, 0.25)
    with torch.no_grad():
        par.lora_A.copy_(a)
        par.lora_B.copy_(local_part(b, par.lora_B))
    x = torch.randn(S, B_, 22, generator=torch.Generator().manual_seed(3))
    outs = []
    for model, inp in ((ref, x), (ref64, x.double()), (par, _seq(x, sp))):
        torch.manual_seed(5)  # the same mask for each
        outs.append(model(inp))
    yr, y64, yp = outs
    undropped = ref.base_layer(x) + F.linear(F.linear(x, a), b) * ref.scaling
    assert (yr - undropped).abs().max() > 1e-3  # a mask was drawn
    agree(yp, _cols(yr, par.lora_B), _cols(y64, par.lora_B), f"dropout sp={sp}", length=22)


@pytest.mark.parametrize("world", [1, 2])
def test_column_dropout_draws_the_single_process_mask(world):
    run_ranks(lambda: [_dropout_column(sp) for sp in (False, True)], world)


def _fp8_base() -> None:
    """A frozen base whose GEMM is in fp8 (``use_fp8``, tensorwise; emulated on a CPU) keeps it
    under the adapter: with B at PEFT's zero, the LoRA layer's output and input gradient are the
    fp8 base's bit for bit (adding exact zeros), and differ from the high-precision base's."""
    from fastpar.nn.fp8_apply import use_fp8

    for make in (ColumnParallelLinear, RowParallelLinear):
        torch.manual_seed(0)
        base = make(64, 64, dtype=torch.bfloat16)
        assert use_fp8(nn.ModuleDict({"layer": base}), "tensorwise") == ["layer"]
        shape = (S, B_, 64 // dist.get_world_size() if make is RowParallelLinear else 64)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16()
        runs = []
        for module in (base, LoRALinear(base, R, ALPHA)):
            xi = x.clone().requires_grad_()
            y = module(xi)
            y.float().square().sum().backward()
            runs.append((y.detach(), xi.grad))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        use_fp8(nn.ModuleDict({"layer": base}), None)
        assert not torch.equal(base(x), runs[0][0])  # the fp8 GEMM was in use


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_base_keeps_its_gemm(world):
    run_ranks(_fp8_base, world)
