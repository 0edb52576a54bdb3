"""Triton kernels of the fused AdamW step.

Interpreter tier (``TRITON_INTERPRET=1``, CPU tensors, Triton forced with
``backend.use_backend("triton")``): the flat and the multi-tensor kernels against
``torch.optim.AdamW(foreach=False)`` and the torch reference, 1 / 123 / 4,099 elements with the
default and with tiny blocks (several programs, a partial last chunk, several launches),
fp32 / fp16 / bf16 gradients, fp16 and bf16 parameter copies, inv_scale and clip_coef, maximize,
both torch.lerp branches, int64 and fp32 step tensors, a large step (β^t by repeated squaring),
per-tensor steps, and the found_inf skip (1 and NaN: nothing written).

Tolerances: exp_avg and exp_avg_sq must be bit-identical to torch (the kernel uses torch's fma
order: the same operations in the same order) wherever both round each multiply-add once:
``tl.fma`` does on every GPU and in the interpreter of Triton >= 3.9, and torch's CPU lerp and
addcmul do in its AVX2 / AVX-512 kernels. The interpreter of Triton 3.8 and older emulates the
fma as ``x * y + z``, and torch's portable kernels (``ATEN_CPU_CAPABILITY=default``) compute
``a * b + c`` too, rounding twice; there (found by running a multiply-add whose two roundings
differ, ``same_fmas``) the moments are judged by the rule against float64 instead. The param
is judged by the rule
of ``fastpar.tolerance`` (``_parity.agree``, length 1: an elementwise update): its error against
AdamW written out in float64 (``_exact_adamw``; ``fastpar.reference.adamw`` computes in fp32
whatever its inputs, so a float64 run of it is not exact) at most 4 x the fp32 runs' own
(the reference, torch.optim.AdamW) + a floor — the kernel takes an IEEE square root where
torch's CPU ``sqrt`` may be an ulp off, which moves the param by an ulp now and then. fp16
copies must equal ``param.half()`` exactly (a cast); the interpreter stores bf16 by truncation,
so bf16 copies are compared within one ulp (exactly on a GPU).

GPU tier (``-m cuda``): the same natively (exp_avg / exp_avg_sq bit-identical to the CPU
reference where its kernels fuse, the copy exactly ``param.to(dtype)``), FusedAdamW against
torch.optim.AdamW on CUDA, and a shard of more than 2^31 elements (int64 offsets).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _adamw import exact_adamw, same_fmas, torch_adamw
from _parity import agree

from fastpar import tolerance
from fastpar.ops import adamw as op
from fastpar.ops import backend
from fastpar.optim.fused_adamw import FusedAdamW
from fastpar.reference import adamw as ref

interpreter = pytest.mark.interpreter
cuda = pytest.mark.cuda
HYPER = dict(lr=1e-3, eps=1e-8, beta2=0.999)
SMALL = dict(block=64, chunk=256)  # many programs and partial chunks even for 4,099 elements


def _kernels():
    from fastpar.kernels import adamw as kernels  # defines kernels: import lazily

    return kernels


def _agree_param(got: torch.Tensor, single, exact: torch.Tensor, what: str = "param") -> None:
    """The param against fp32 run(s) ``single`` and float64 ``exact`` by the rule (length 1)."""
    agree(got, single, exact, what, length=1)


_exact_adamw = functools.partial(exact_adamw, **HYPER)  # (p, m, v) in float64


def _assert_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"


def _assert_moments(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """exp_avg / exp_avg_sq of a kernel against torch's CPU ones (``want``): bit for bit where
    both round each multiply-add once (``same_fmas``), else by the rule against float64."""
    if same_fmas():
        _assert_exact(got, want)
    else:
        agree(got, want, exact, what, length=1)


def _assert_copy(lp: torch.Tensor, p: torch.Tensor, exact: bool) -> None:
    """``lp == p.to(lp.dtype)``; within one bf16 ulp unless ``exact``."""
    want = p.to(lp.dtype)
    if exact or lp.dtype == torch.float16:
        _assert_exact(lp, want)
    else:
        bits = (lp.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(bits.max()) <= 1


_torch_adamw = functools.partial(torch_adamw, **HYPER)  # (p, m, v) of torch.optim.AdamW


def _run_flat(p0, grads, *, device, steps_from=0, step_dtype=torch.int64, lp_dtype=None, **kw):
    """The op (under the active backend) over ``grads``; returns (p, m, v, lp)."""
    n = p0.numel()
    p = p0.clone().to(device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    lp = None if lp_dtype is None else torch.empty(n, dtype=lp_dtype, device=device)
    step = torch.tensor(steps_from, dtype=step_dtype, device=device)
    for g in grads:
        step += 1
        op.adamw_step_(p, g.to(device), m, v, step=step, param_lp=lp, **HYPER, **kw)
    return p, m, v, lp


FLAT_CASES = [
    # id, grad dtype, copy dtype, beta1, weight decay, maximize, step dtype, small blocks
    ("fp32", torch.float32, None, 0.9, 0.1, False, torch.int64, False),
    ("fp16-copy", torch.float16, torch.float16, 0.9, 0.1, False, torch.float32, True),
    ("bf16-copy", torch.bfloat16, torch.bfloat16, 0.9, 0.0, False, torch.int64, True),
    ("maximize-beta1_0.3", torch.float32, None, 0.3, 0.0, True, torch.float32, True),
]


@interpreter
@pytest.mark.parametrize("numel", [1, 123, 4099])
@pytest.mark.parametrize("case", FLAT_CASES, ids=[c[0] for c in FLAT_CASES])
def test_flat_kernel_interpreted(numel, case):
    _, g_dtype, lp_dtype, beta1, wd, maximize, step_dtype, small = case
    gen = torch.Generator().manual_seed(numel)
    p0 = torch.randn(numel, generator=gen) * 1e-2  # the size of the updates: tight check
    grads = [(torch.randn(numel, generator=gen) * 1e-2).to(g_dtype) for _ in range(3)]
    kw = dict(beta1=beta1, weight_decay=wd, maximize=maximize, lp_dtype=lp_dtype)
    kw["step_dtype"] = step_dtype
    with backend.use_backend("reference"):
        want = _run_flat(p0, grads, device="cpu", **kw)
    if small:  # tiny blocks through the launcher itself (the op uses the defaults)
        got = _run_kernel_small(p0, grads, **kw)
    else:
        with backend.use_backend("triton"):
            got = _run_flat(p0, grads, device="cpu", **kw)
    oracle = _torch_adamw(p0, grads, beta1=beta1, weight_decay=wd, maximize=maximize)
    exact = _exact_adamw(p0, grads, beta1=beta1, weight_decay=wd, maximize=maximize)
    _agree_param(got[0], [want[0], oracle[0]], exact[0])
    for res in (want, oracle):
        _assert_moments(got[1], res[1], exact[1], "exp_avg")
        _assert_moments(got[2], res[2], exact[2], "exp_avg_sq")
    if lp_dtype is not None:
        _assert_copy(got[3], got[0], exact=False)


def _run_kernel_small(p0, grads, *, lp_dtype, step_dtype, steps_from=0, **kw):
    k = _kernels()
    n = p0.numel()
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    lp = None if lp_dtype is None else torch.empty(n, dtype=lp_dtype)
    step = torch.tensor(steps_from, dtype=step_dtype)
    for g in grads:
        step += 1
        k.adamw_step_(p, g, m, v, step=step, param_lp=lp, **HYPER, **kw, **SMALL)
    return p, m, v, lp


@interpreter
def test_inv_scale_clip_and_large_step_interpreted():
    """Scaled grads against torch on pre-multiplied grads; steps 12,345.. (β^t by squaring)."""
    numel, scale = 4099, 2.0**10
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(numel, generator=gen) * 1e-2  # the size of the updates: tight check
    grads = [(torch.randn(numel, generator=gen) * 1e-2 * scale).half() for _ in range(2)]
    inv, clip = torch.tensor(1 / scale), torch.tensor(0.3711)
    kw = dict(beta1=0.9, weight_decay=0.1, inv_scale=inv, clip_coef=clip, steps_from=12_344)
    with backend.use_backend("triton"):
        got = _run_flat(p0, grads, device="cpu", **kw)
    with backend.use_backend("reference"):
        want = _run_flat(p0, grads, device="cpu", **kw)
    exact_kw = dict(beta1=0.9, weight_decay=0.1, pre=lambda g: g * inv.double() * clip.double())
    exact = _exact_adamw(p0, grads, steps_from=12_344, **exact_kw)
    _agree_param(got[0], want[0], exact[0], "param at step 12,346")
    _assert_moments(got[1], want[1], exact[1], "exp_avg at step 12,346")
    _assert_moments(got[2], want[2], exact[2], "exp_avg_sq at step 12,346")
    # the first update against torch AdamW fed pre-multiplied grads (torch starts at step 1)
    with backend.use_backend("triton"):
        got1 = _run_flat(p0, grads[:1], device="cpu", **{**kw, "steps_from": 0})
    oracle = _torch_adamw(p0, grads[:1], beta1=0.9, weight_decay=0.1, pre=lambda g: g * inv * clip)
    exact1 = _exact_adamw(p0, grads[:1], **exact_kw)
    _agree_param(got1[0], oracle[0], exact1[0], "param at step 1")
    _assert_moments(got1[1], oracle[1], exact1[1], "exp_avg at step 1")
    _assert_moments(got1[2], oracle[2], exact1[2], "exp_avg_sq at step 1")


def _multi_setup(device):
    sizes = [1, 0, 123, 4099, 77]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float32]
    lp_dtypes = [None, None, torch.bfloat16, torch.float16, torch.float16]
    gen = torch.Generator().manual_seed(7)
    p0 = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    grads = [
        [(torch.randn(n, generator=gen) * 1e-2).to(dt) for _ in range(3)]
        for n, dt in zip(sizes, dtypes, strict=True)
    ]
    return sizes, p0, grads, lp_dtypes


def _exact_multi(p0, grads) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``_run_multi``'s (p, m, v) per tensor in float64 (tensor 3 five steps ahead)."""
    return [
        _exact_adamw(p, g, beta1=0.9, weight_decay=0.1, steps_from=5 if i == 3 else 0)
        for i, (p, g) in enumerate(zip(p0, grads, strict=True))
    ]


def _run_multi(sizes, p0, grads, lp_dtypes, device, launcher):
    ps = [p.clone().to(device) for p in p0]
    ms = [torch.zeros(n, device=device) for n in sizes]
    vs = [torch.zeros(n, device=device) for n in sizes]
    lps = [
        None if dt is None else torch.empty(n, dtype=dt, device=device)
        for n, dt in zip(sizes, lp_dtypes, strict=True)
    ]
    steps = [torch.zeros((), device=device) for _ in sizes]
    steps[3] += 5  # per-tensor steps: tensor 3 is ahead
    for k in range(3):
        torch._foreach_add_(steps, 1.0)
        launcher(
            ps,
            [g[k].to(device) for g in grads],
            ms,
            vs,
            beta1=0.9,
            weight_decay=0.1,
            steps=steps,
            params_lp=lps,
            **HYPER,
        )
    return ps, ms, vs, lps


@interpreter
def test_multi_tensor_kernel_interpreted():
    """Mixed dtypes, an empty tensor, per-tensor steps; tiny blocks and 3 programs a launch."""
    sizes, p0, grads, lp_dtypes = _multi_setup("cpu")

    def small(*args, **kw):
        _kernels().adamw_step_multi_(*args, **kw, **SMALL, max_programs=3)

    got = _run_multi(sizes, p0, grads, lp_dtypes, "cpu", small)
    with backend.use_backend("triton"):
        got_op = _run_multi(sizes, p0, grads, lp_dtypes, "cpu", op.adamw_step_multi_)
    with backend.use_backend("reference"):
        want = _run_multi(sizes, p0, grads, lp_dtypes, "cpu", op.adamw_step_multi_)
    exact = _exact_multi(p0, grads)
    for name, res in (("launcher", got), ("op", got_op)):
        for i in range(len(sizes)):
            _agree_param(res[0][i], want[0][i], exact[i][0], f"{name}: param {i}")
            _assert_moments(res[1][i], want[1][i], exact[i][1], f"{name}: exp_avg {i}")
            _assert_moments(res[2][i], want[2][i], exact[i][2], f"{name}: exp_avg_sq {i}")
            if lp_dtypes[i] is not None:
                _assert_copy(res[3][i], res[0][i], exact=False)
    # tensor 0 against torch AdamW (from step 1)
    oracle = _torch_adamw(p0[0], grads[0], beta1=0.9, weight_decay=0.1)
    _agree_param(got[0][0], oracle[0], exact[0][0], "param 0 against torch")


@interpreter
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # lr / (1 - β1^0), unused
@pytest.mark.parametrize("flag", [1.0, float("nan")], ids=["one", "nan"])
@pytest.mark.parametrize("form", ["flat", "multi"])
def test_found_inf_skips_everything_interpreted(flag, form):
    n = 4099
    gen = torch.Generator().manual_seed(9)
    p, m, v = torch.randn(n, generator=gen), torch.rand(n), torch.rand(n)
    lp = torch.randn(n, generator=gen).half()
    grads = torch.full((n,), float("inf"))
    before = [t.clone() for t in (p, m, v, lp)]
    kw = dict(beta1=0.9, weight_decay=0.1, found_inf=torch.tensor(flag), **HYPER)
    with backend.use_backend("triton"):
        if form == "flat":
            op.adamw_step_(p, grads, m, v, step=torch.tensor(0), param_lp=lp, **kw)
        else:
            op.adamw_step_multi_(
                [p], [grads], [m], [v], steps=torch.zeros(()), params_lp=[lp], **kw
            )
    for got, want in zip((p, m, v, lp), before, strict=True):
        _assert_exact(got, want)


@interpreter
def test_fused_adamw_triton_interpreted():
    """FusedAdamW forced onto Triton against torch.optim.AdamW, fed the same gradients."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(17, 33), (17,), (1,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    p0 = [p.detach().clone() for p in ours]
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    fed = []
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        fed.append(grads)
        for params, o in ((ours, opt), (theirs, ref_opt)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            with backend.use_backend("triton"):
                o.step()
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        exact = _exact_adamw(p0[i], [g[i] for g in fed], beta1=0.9, weight_decay=0.1, lr=1e-2)
        _agree_param(a.detach(), b.detach(), exact[0], f"param {i}")
        _assert_moments(
            opt.state[a]["exp_avg"], ref_opt.state[b]["exp_avg"], exact[1], f"exp_avg {i}"
        )
        _assert_moments(
            opt.state[a]["exp_avg_sq"], ref_opt.state[b]["exp_avg_sq"], exact[2], f"exp_avg_sq {i}"
        )
        assert int(opt.state[a]["step"]) == 3


# ---------------------------------------------------------------- GPU tier


@cuda
@pytest.mark.parametrize("numel", [1, 123, 4099, 1_000_003])
@pytest.mark.parametrize(
    ("g_dtype", "lp_dtype"),
    [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    ids=["fp32", "bf16", "fp16"],
)
def test_flat_kernel_cuda(numel, g_dtype, lp_dtype):
    gen = torch.Generator().manual_seed(numel)
    p0 = torch.randn(numel, generator=gen) * 1e-2  # the size of the updates: tight check
    grads = [(torch.randn(numel, generator=gen) * 1e-2).to(g_dtype) for _ in range(5)]
    kw = dict(beta1=0.9, weight_decay=0.1, lp_dtype=lp_dtype)
    got = _run_flat(p0, grads, device="cuda", **kw)  # CUDA tensors take Triton
    with backend.use_backend("reference"):
        want = _run_flat(p0, grads, device="cpu", **kw)
    exact = _exact_adamw(p0, grads, beta1=0.9, weight_decay=0.1)
    _agree_param(got[0].cpu(), want[0], exact[0])
    _assert_moments(got[1].cpu(), want[1], exact[1], "exp_avg")
    _assert_moments(got[2].cpu(), want[2], exact[2], "exp_avg_sq")
    if lp_dtype is not None:
        _assert_copy(got[3], got[0], exact=True)
    oracle = _torch_adamw(p0.cuda(), [g.cuda() for g in grads], beta1=0.9, weight_decay=0.1)
    for name, a, b, c in zip(
        ("param", "exp_avg", "exp_avg_sq"), got[:3], oracle, exact, strict=True
    ):
        agree(a.cpu(), b.cpu(), c, f"{name} against torch on CUDA", length=1)


@cuda
def test_multi_and_skip_cuda():
    sizes, p0, grads, lp_dtypes = _multi_setup("cuda")
    got = _run_multi(sizes, p0, grads, lp_dtypes, "cuda", op.adamw_step_multi_)
    with backend.use_backend("reference"):
        want = _run_multi(sizes, p0, grads, lp_dtypes, "cpu", op.adamw_step_multi_)
    exact = _exact_multi(p0, grads)
    for i in range(len(sizes)):
        _agree_param(got[0][i].cpu(), want[0][i], exact[i][0], f"param {i}")
        _assert_moments(got[1][i].cpu(), want[1][i], exact[i][1], f"exp_avg {i}")
        _assert_moments(got[2][i].cpu(), want[2][i], exact[i][2], f"exp_avg_sq {i}")
        if lp_dtypes[i] is not None:
            _assert_copy(got[3][i], got[0][i], exact=True)
    before = [t.clone() for t in got[0]]
    op.adamw_step_multi_(
        got[0],
        [torch.full_like(p, float("nan")) for p in got[0]],
        got[1],
        got[2],
        beta1=0.9,
        weight_decay=0.1,
        steps=torch.zeros((), device="cuda"),
        found_inf=torch.ones((), device="cuda"),
        **HYPER,
    )
    for a, b in zip(got[0], before, strict=True):
        _assert_exact(a, b)


@cuda
def test_fused_adamw_cuda_matches_torch():
    """10 steps of FusedAdamW on CUDA against the same training with torch.optim.AdamW: on the
    GPU, and on the CPU in fp32 (with its twin) and float64 (``tolerance.train_references``),
    each param by the rule with AdamW's slack (the gradients are computed, not given)."""
    torch.manual_seed(0)
    ours = torch.nn.Linear(257, 129).cuda()
    theirs = torch.nn.Linear(257, 129).cuda()
    theirs.load_state_dict(ours.state_dict())
    opt = FusedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    x = torch.randn(64, 257, device="cuda")
    for _ in range(10):
        for model, o in ((ours, opt), (theirs, ref_opt)):
            model(x).square().mean().backward()
            o.step()
            o.zero_grad()
    x_cpu = x.cpu()
    refs = tolerance.train_references(
        lambda: torch.nn.Linear(257, 129),  # under torch.manual_seed(0): the same weights
        lambda model, step, dtype: model(x_cpu.to(dtype)).square().mean(),
        10,
        length=257,
        lr=1e-2,
        weight_decay=0.1,
    )
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        verdict = refs.param(name, a.detach().cpu())
        assert verdict.ok, verdict
        torch_verdict = refs.param(name, b.detach().cpu())  # torch on CUDA, the same bound
        assert torch_verdict.ok, torch_verdict


@cuda
def test_shard_beyond_int32_cuda():
    """2^31 + 3,000 elements (about 30 GB): the tail, past 2^31, is updated like the reference."""
    n = 2**31 + 3_000
    if torch.cuda.mem_get_info()[0] < 40 * 2**30:
        pytest.skip("needs about 40 GiB of free GPU memory")
    tail = 8_192
    gen = torch.Generator().manual_seed(3)
    p_tail = torch.randn(tail, generator=gen)
    g_tail = (torch.randn(tail, generator=gen) * 1e-2).bfloat16()
    p = torch.zeros(n, device="cuda")
    g = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    p[-tail:] = p_tail.cuda()
    g[-tail:] = g_tail.cuda()
    step = torch.ones((), device="cuda")
    op.adamw_step_(p, g, m, v, beta1=0.9, weight_decay=0.1, step=step, **HYPER)
    p_ref, m_ref, v_ref = p_tail.clone(), torch.zeros(tail), torch.zeros(tail)
    ref.adamw_step_(
        p_ref, g_tail, m_ref, v_ref, beta1=0.9, weight_decay=0.1, step=torch.ones(()), **HYPER
    )
    exact = _exact_adamw(p_tail, [g_tail], beta1=0.9, weight_decay=0.1)
    _agree_param(p[-tail:].cpu(), p_ref, exact[0], "the tail's param")
    _assert_moments(m[-tail:].cpu(), m_ref, exact[1], "the tail's exp_avg")
    _assert_moments(v[-tail:].cpu(), v_ref, exact[2], "the tail's exp_avg_sq")
    assert int(torch.count_nonzero(p[: n - tail])) == 0
