"""bf16 optimizer state: ``FusedAdamW(state_dtype=torch.bfloat16)`` keeps exp_avg and
exp_avg_sq in bf16 (updated in fp32, stored rounded to nearest even).

* The optimizer is the op: bit for bit ``adamw_step_multi_`` with bf16 moments, one call per
  param group with the same per-tensor steps (the same kernels in the same order).
* Against an independent float64 AdamW (``tests/_adamw.py``) driven each step from the state the
  run stored: the params within one fp32 rounding of the elementwise update (``fastpar.tolerance``'s
  floor, length 1), the stored moments exactly the float64 moments rounded to bf16 — except where
  the float64 value lies within the fp32 computation's error of a rounding boundary, where
  either neighbour is right. Truncating instead of rounding is caught.
* State dicts keep the dtype; a state of the other dtype is refused (TypeError).
* Through ``Replicate`` / ``Shard`` (ZeRO 0-3) at world 2: both ranks fed the same batch, so the
  average of the two equal gradients is exact and every element takes the same elementwise ops
  as one process: bit for bit the single-process ``FusedAdamW``; the state is bf16.
* Memory: the planner's optimizer bytes (``adamw_state_bytes``) equal the allocated state's
  (sum of nbytes, less each flat's 0-dim fp32 "step") at ZeRO 0-3, half of fp32's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _adamw import exact_adamw_step
from torch import nn

from fastpar import tolerance
from fastpar.ops.adamw import adamw_step_multi_
from fastpar.optim import FusedAdamW
from fastpar.parallel import Replicate, Shard
from fastpar.reference.optimizer import ExactAdamW
from fastpar.testing import run_ranks
from fastpar.zero import adamw_state_bytes, estimate_memory

BF16 = torch.bfloat16
SHAPES = [(5, 7), (13,), (3, 4, 2), (1,)]
HYPER = dict(lr=1e-2, eps=1e-8, weight_decay=0.1)
BETAS = (0.9, 0.999)
U32 = tolerance.unit_roundoff(torch.float32)


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * 10.0 ** (i - 2) for i, s in enumerate(SHAPES)]


def test_bf16_state_is_the_op_bit_for_bit():
    ps = _params()
    groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
    opt = FusedAdamW(groups, betas=BETAS, state_dtype=BF16, **HYPER)
    ref = [p.detach().clone() for p in ps]
    ms = [torch.zeros_like(p, dtype=BF16) for p in ref]
    vs = [torch.zeros_like(p, dtype=BF16) for p in ref]
    steps = [torch.zeros(()) for _ in ref]
    for s in range(4):
        for p, g in zip(ps, _grads(s), strict=True):
            p.grad = g.clone()
        opt.step()
        for sl, wd in ((slice(0, 2), HYPER["weight_decay"]), (slice(2, None), 0.0)):
            torch._foreach_add_(steps[sl], 1.0)
            adamw_step_multi_(
                ref[sl],
                _grads(s)[sl],
                ms[sl],
                vs[sl],
                lr=HYPER["lr"],
                beta1=BETAS[0],
                beta2=BETAS[1],
                eps=HYPER["eps"],
                weight_decay=wd,
                steps=steps[sl],
            )
    for i, p in enumerate(ps):
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == BF16
        assert torch.equal(p.detach(), ref[i]), i
        assert torch.equal(st["exp_avg"], ms[i]) and torch.equal(st["exp_avg_sq"], vs[i]), i
        assert float(st["step"]) == 4.0


def _check_moment(stored, exact, delta, what):
    """``stored`` (bf16) is ``exact`` (float64, before rounding) rounded to nearest, except
    where a value within ``delta`` of ``exact`` rounds otherwise (the fp32 computation may land
    there): then it is one of the two roundings."""
    lo, hi = (exact - delta).to(BF16), (exact + delta).to(BF16)
    ok = (stored == exact.to(BF16)) | ((lo != hi) & ((stored == lo) | (stored == hi)))
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} of {ok.numel()} not rounded to nearest"


def _against_float64(corrupt=None) -> None:
    """Steps of FusedAdamW (bf16 state), each judged against float64 from the state before it;
    ``corrupt(t)`` (a planted fault) replaces each stored moment before the judgement."""
    ps = _params()
    opt = FusedAdamW(ps, betas=BETAS, state_dtype=BF16, **HYPER)
    beta1, beta2 = BETAS
    for s in range(4):
        gs = _grads(s)
        before = [
            (p.detach().double(), *(opt.state[p][k].double() for k in ("exp_avg", "exp_avg_sq")))
            if opt.state
            else (p.detach().double(), torch.zeros_like(p, dtype=torch.float64), None)
            for p in ps
        ]
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, (p, g) in enumerate(zip(ps, gs, strict=True)):
            p0, m0, v0 = before[i]
            v0 = torch.zeros_like(m0) if v0 is None else v0
            g64 = g.double()
            p64, m64, v64 = exact_adamw_step(
                p0, m0, v0, g64, s + 1, beta1=beta1, beta2=beta2, **HYPER
            )
            # one elementwise update in fp32: a few roundings of |p|, the rule's floor (n = 1)
            err = tolerance.max_error(p.detach(), p64)
            assert err <= tolerance.floor(torch.float32, 1, tolerance.magnitude(p64)), (s, i, err)
            # the fp32 moments before rounding: each of the two products and the sum rounded
            m_err = 4 * U32 * (beta1 * m0.abs() + (1 - beta1) * g64.abs())
            v_err = 4 * U32 * (beta2 * v0 + (1 - beta2) * g64.square())
            st = opt.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            if corrupt is not None:
                m, v = corrupt(m, m64), corrupt(v, v64)
            _check_moment(m, m64, m_err, f"exp_avg {i} step {s + 1}")
            _check_moment(v, v64, v_err, f"exp_avg_sq {i} step {s + 1}")


def test_bf16_state_against_float64_with_the_moments_rounded():
    _against_float64()


def _truncated(stored: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """The float64 moment stored by dropping the low bits (a kernel that truncates)."""
    return (exact.float().view(torch.int32) & -65536).view(torch.float32).to(BF16)


def test_the_float64_check_catches_truncated_moments():
    with pytest.raises(AssertionError, match="not rounded to nearest"):
        _against_float64(corrupt=_truncated)


def test_state_dtype_is_checked_and_kept_by_state_dicts():
    with pytest.raises(TypeError, match=r"state_dtype torch\.float16 is not supported"):
        FusedAdamW(_params(), state_dtype=torch.float16)

    def run(opt, ps, steps):
        for s in steps:
            for p, g in zip(ps, _grads(s), strict=True):
                p.grad = g.clone()
            opt.step()

    ps = _params()
    opt = FusedAdamW(ps, state_dtype=BF16, **HYPER)
    run(opt, ps, range(2))
    saved = copy.deepcopy(opt.state_dict())  # (its tensors are the live state)
    weights = [p.detach().clone() for p in ps]
    run(opt, ps, range(2, 4))
    qs = [nn.Parameter(w.clone()) for w in weights]
    again = FusedAdamW(qs, state_dtype=BF16, **HYPER)
    again.load_state_dict(saved)
    assert {again.state[q]["exp_avg_sq"].dtype for q in qs} == {BF16}
    run(again, qs, range(2, 4))  # resumed: bit for bit the uninterrupted run
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p.detach(), q.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], again.state[q][key])
    with pytest.raises(TypeError, match=r"holds exp_avg in torch\.bfloat16.*state_dtype=torch\.bf"):
        FusedAdamW(qs, **HYPER).load_state_dict(saved)
    fp32 = FusedAdamW(qs, **HYPER)
    run(fp32, qs, range(1))
    with pytest.raises(TypeError, match=r"holds exp_avg in torch\.float32, this FusedAdamW keeps"):
        FusedAdamW(qs, state_dtype=BF16, **HYPER).load_state_dict(fp32.state_dict())


# -- the data-parallel family -----------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: the flats need padding
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(6, 7, generator=g), torch.randn(6, 5, generator=g)


def _wrap(stage: int, model: nn.Module, state_dtype: torch.dtype):
    adamw = lambda ps: FusedAdamW(ps, state_dtype=state_dtype, **HYPER)  # noqa: E731
    if stage == 0:
        return Replicate(model, adamw)
    unit = {"wrap": (nn.Linear,)} if stage == 3 else {}
    return Shard(model, adamw, stage=stage, **unit)


def _data_parallel(stage: int, steps: int, state_dtype: torch.dtype = BF16) -> dict:
    """``steps`` steps at ``stage``, every rank on the same batch: the final parameters, the
    state's dtypes and bytes, the planner's numbers."""
    w = _wrap(stage, _mlp(), state_dtype)
    for s in range(steps):
        x, y = _batch(s)
        F.mse_loss(w(x), y).backward()
        w.step()
        w.zero_grad()
    with w.summon_full_params():
        params = [p.detach().clone() for p in w.module.parameters()]
    states = list(w.optimizer.state.values())
    return {
        "params": params,
        "dtypes": {k: v.dtype for st in states for k, v in st.items()},
        "held": w.memory_bytes(),
        "flats": [f.bucket.numel for f in w.flats],
        "steps": sum(st["step"].nbytes for st in states),
    }


def _single(steps: int) -> list[torch.Tensor]:
    model = _mlp()
    opt = FusedAdamW(model.parameters(), state_dtype=BF16, **HYPER)
    for s in range(steps):
        x, y = _batch(s)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel_bf16_state_is_the_single_process_bit_for_bit(stage):
    want = _single(3)
    for r in run_ranks(_data_parallel, 2, stage, 3):
        assert r["dtypes"] == {"step": torch.float32, "exp_avg": BF16, "exp_avg_sq": BF16}
        for a, b in zip(r["params"], want, strict=True):
            assert torch.equal(a, b)


def _train(w, steps) -> None:
    for s in steps:
        x, y = _batch(s)
        F.mse_loss(w(x), y).backward()
        w.step()
        w.zero_grad()


def _resharded(path: str, stage: int, state_dtype: torch.dtype):
    """2 steps at ZeRO-1 (bf16 state), saved by fastpar.checkpoint; a fresh wrapper at
    ``stage`` with ``state_dtype`` loads it and trains 2 more: (its parameters, the state's
    dtypes), or the load's TypeError text."""
    from fastpar import checkpoint

    w = _wrap(1, _mlp(), BF16)
    _train(w, range(2))
    checkpoint.save(path, model_params=dict(w.module.named_parameters()), optimizer=w, step=2)
    fresh = _wrap(stage, _mlp(), state_dtype)
    try:
        with fresh.summon_full_params():  # (ZeRO-3: the full parameters, as the trainer loads)
            names = dict(fresh.module.named_parameters())
            checkpoint.load(path, model_params=names, optimizer=fresh)
    except TypeError as exc:
        return str(exc)
    _train(fresh, range(2, 4))
    with fresh.summon_full_params():
        params = [p.detach().clone() for p in fresh.module.parameters()]
    return params, {v.dtype for st in fresh.optimizer.state.values() for v in st.values()}


@pytest.mark.parametrize("stage", [3, pytest.param(0, marks=pytest.mark.slow)])
def test_a_bf16_checkpoint_reshards_across_zero_stages_bit_for_bit(tmp_path, stage):
    want = _single(4)
    for params, dtypes in run_ranks(_resharded, 2, str(tmp_path / "ckpt"), stage, BF16):
        assert dtypes == {torch.float32, BF16}
        for a, b in zip(params, want, strict=True):
            assert torch.equal(a, b)
    for text in run_ranks(_resharded, 2, str(tmp_path / "other"), stage, torch.float32):
        assert "holds exp_avg in torch.bfloat16" in text


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_planner_counts_the_allocated_bf16_state(stage):
    world = 2
    bf16 = run_ranks(_data_parallel, world, stage, 1)
    fp32 = run_ranks(_data_parallel, world, stage, 1, torch.float32)
    for low, full in zip(bf16, fp32, strict=True):
        # fp32 parameters: the master is the parameter buffer itself (no separate master)
        plan = estimate_memory(
            sum(low["flats"]),
            world,
            stage,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=adamw_state_bytes(BF16, master=False),
            mode="fastpar",
            bucket_numels=low["flats"],
        )
        assert low["held"]["masters"] == 0
        assert low["held"]["optimizer"] - low["steps"] == plan.optimizer
        assert low["held"]["params"] == plan.params and low["held"]["grads"] == plan.grads
        # the moments are half of fp32's: 4 of 8 bytes an element here, 4 of 12 with a master
        assert (
            2 * (low["held"]["optimizer"] - low["steps"])
            == full["held"]["optimizer"] - (full["steps"])
        )
    assert adamw_state_bytes() == 12 and adamw_state_bytes(BF16) == 8


def test_the_planner_command_takes_the_state_dtype(capsys):
    from fastpar.zero.__main__ import main

    main(["--params", "1e9", "--dp", "1", "4", "--optimizer-state-dtype", "bf16"])
    out = capsys.readouterr().out.splitlines()
    assert "K = 8" in out[0]
    # the paper's model, K = 8: 2 + 2 + 8 bytes a parameter at DP 1; 2 + 2 + 8/4 at stage 1, DP 4
    assert out[2].split() == ["1", "12", "12", "12", "12"]
    assert out[3].split()[:2] == ["4", "12"] and float(out[3].split()[2]) == 6.0


@pytest.mark.slow
def test_the_exact_reference_rounds_and_its_slack_covers_the_run():
    """``ExactAdamW(state_dtype=bf16)`` (fastpar.verify's float64 reference) stores each moment
    as float64 AdamW's (``tests/_adamw.py``, from its stored state) rounded to bf16, and allows
    nothing at the first step. Against the real run (FusedAdamW, bf16 state, fp32) on 2^18
    elements some moments round the other way (the fp32 value past a bf16 midpoint): the
    parameters move beyond the fp32 steps' own rounding there, and stay within the slack
    verify allows (``ADAM_FACTOR`` x ``rounding_slack``) plus that rounding everywhere (measured:
    7-11 such elements, each at most 0.09 x ``rounding_slack`` beyond the rounding)."""
    n, steps = 1 << 18, 4
    gen = torch.Generator().manual_seed(0)
    p32 = nn.Parameter(torch.randn(n, generator=gen))
    p64 = nn.Parameter(p32.detach().double())
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(steps)]
    run = FusedAdamW([p32], betas=BETAS, state_dtype=BF16, **HYPER)
    exact = ExactAdamW([{"params": [p64]}], betas=BETAS, state_dtype=BF16, **HYPER)
    u64 = tolerance.unit_roundoff(torch.float64)
    m0 = v0 = torch.zeros(n, dtype=torch.float64)
    rounding = torch.zeros(n, dtype=torch.float64)
    for s, g in enumerate(grads):
        p0, g64 = p64.detach().clone(), g.double()
        p32.grad, p64.grad = g.clone(), g64.clone()
        run.step()
        exact.step()
        _, m64, v64 = exact_adamw_step(
            p0, m0, v0, g64, s + 1, beta1=BETAS[0], beta2=BETAS[1], **HYPER
        )
        state = exact.optimizer.state[p64]
        m0, v0 = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        _check_moment(m0.to(BF16), m64, 8 * u64 * (m64.abs() + g64.abs()), "exp_avg")
        _check_moment(v0.to(BF16), v64, 8 * u64 * (v64 + g64.square()), "exp_avg_sq")
        assert torch.equal(m0, m0.to(BF16).double()) and torch.equal(v0, v0.to(BF16).double())
        if s == 0:
            assert float(exact.rounding_slack[p64].abs().max()) == 0.0
        rounding += tolerance.floor(torch.float32, 1, 1.0) * p64.detach().abs()
    diff = (p32.detach().double() - p64.detach()).abs()
    slack = tolerance.ADAM_FACTOR * exact.rounding_slack[p64]
    assert bool((diff <= slack + rounding).all()), float((diff - slack - rounding).max())
    beyond = int((diff > rounding).sum())
    assert beyond > 0, "no moment rounded the other way: the slack was not exercised"
