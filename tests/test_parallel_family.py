"""The data-parallel family behind one protocol: ``Replicate`` (stage 0) and ``Shard`` (stages 1,
2, 3) give the same training, the same ``zero_grad`` / ``no_sync`` / ``finish_grad_sync`` /
``step`` semantics and the same ``comm_bytes`` form at every stage; unused parameters at every
stage; ZeRO-3 under a pipeline with tied embeddings (the trainer, proven by ``fastpar.verify``);
and the MoE auxiliary-loss weight the pipeline engine sets.

A data-parallel step sums gradients in another order than the single process, so "the same
training" is ``fastpar.tolerance``'s rule (docs/tolerances.md) against the same math in float64,
beside the fp32 single-process run and its twin; the gradients of one rank's two passes over
the same micro-batches are the same kernels in the same order, and equal bit for bit."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _flags import tiny_config
from _mesh import make_mesh
from _parity import agree, exact_copy
from _training import check, norm, references
from torch import nn

from fastpar.moe import MoE, moe_aux_loss
from fastpar.parallel import DataParallel, DistributedDataParallel, GradSync, Replicate, Shard
from fastpar.parallel.pipeline import GPipe, PipelineEngine, build_stage
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig
from fastpar.verify import compare
from fastpar.zero import Zero3, ZeroOptimizer

STAGES = (0, 1, 2, 3)
LR, CLIP = 0.1, 0.05  # the clip is below the norm: clipping happens


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: the flats need padding
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5))


def _wrap(stage: int, model: nn.Module, **kwargs) -> DataParallel:
    sgd = lambda ps: torch.optim.SGD(ps, lr=LR)  # noqa: E731
    if stage == 0:
        return Replicate(model, sgd, **kwargs)
    unit = {"wrap": (nn.Linear,)} if stage == 3 else {}
    return Shard(model, sgd, stage=stage, **unit, **kwargs)


def _batch(world: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(world, 4, 7, generator=g), torch.randn(world, 4, 5, generator=g)


def _two_halves(w, x, y) -> None:
    """One mini-batch in two micro-batches, the first inside no_sync (its mean loss)."""
    with w.no_sync():
        (F.mse_loss(w(x[:2]), y[:2]) / 2).backward()
    (F.mse_loss(w(x[2:]), y[2:]) / 2).backward()


def _grads_seen(w, net) -> list:
    """What a parameter's .grad is between steps: None, or a zero tensor."""
    return [None if p.grad is None else bool((p.grad == 0).all()) for p in net.parameters()]


def _protocol() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = (t[rank] for t in _batch(world))
    out = {}
    for stage in STAGES:
        net = _mlp()
        w = _wrap(stage, net, max_grad_norm=CLIP)
        assert isinstance(w, DataParallel) and isinstance(w, GradSync)
        assert isinstance(inspect.getattr_static(type(w), "comm_bytes"), property)
        _two_halves(w, x, y)
        w.finish_grad_sync()
        w.finish_grad_sync()  # idempotent
        reduced = [g.clone() for g in w.shard_grads]
        seen = []
        for set_to_none in (True, False):  # one meaning: the next backward starts from zero
            w.zero_grad(set_to_none=set_to_none)
            seen.append(_grads_seen(w, net))
            _two_halves(w, x, y)
            for a, b in zip(w.shard_grads, reduced, strict=True):  # the same passes, kernels
                assert torch.equal(a, b), f"stage {stage}: zero_grad left a gradient behind"
        skipped, norm = w.step()
        w.zero_grad()
        with w.summon_full_params():
            params = [p.detach().clone() for p in net.parameters()]
        sent = sum(v for k, v in w.comm_bytes_by.items() if k != "summon")
        out[stage] = dict(
            skipped=(skipped.dtype, skipped.dim(), bool(skipped)),
            norm=(norm.dtype, float(norm)),
            params=params,
            seen=seen,
            sent=(w.comm_bytes, sent),
        )
    return out


def _loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = _batch(2)
    return F.mse_loss(model(x.reshape(-1, 7).to(dtype)), y.reshape(-1, 5).to(dtype))


def test_every_stage_speaks_one_protocol_and_trains_alike():
    # one clipped SGD step on the whole batch: fp32, its twin, float64
    refs = references(
        _mlp,
        _loss,
        1,
        lambda m: torch.optim.SGD(m.parameters(), lr=LR),
        length=2 * 4 * 5,
        clip=CLIP,
    )
    names = [n for n, _ in _mlp().named_parameters()]
    for rank, out in enumerate(run_ranks(_protocol, 2)):
        for stage, r in out.items():
            assert r["skipped"] == (torch.bool, 0, False)
            assert r["norm"][0] == torch.float32
            where = f"rank {rank}, stage {stage}: "
            check(
                [norm(refs, 0, r["norm"][1])]
                + [refs.param(n, p) for n, p in zip(names, r["params"], strict=True)],
                where,
            )
            # between steps .grad is None after zero_grad() at every stage; after
            # zero_grad(set_to_none=False) a zeroed view at stages 0 and 1, None at 2 and 3
            n = len(names)
            want = [True] * n if stage <= 1 else [None] * n
            assert r["seen"] == [[None] * n, want], f"stage {stage}"
            assert r["sent"][0] == r["sent"][1] > 0


def test_the_historical_wrappers_are_the_family():
    """DistributedDataParallel, ZeroOptimizer and Zero3 keep their signatures and speak the
    same protocol (one process, no process group)."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=LR)  # noqa: E731
    wrappers = [
        DistributedDataParallel(_mlp()),
        ZeroOptimizer(torch.optim.SGD(_mlp().parameters(), lr=LR), stage=2),
        Zero3(_mlp(), sgd, wrap=(nn.Linear,)),
    ]
    assert [w.stage for w in wrappers] == [0, 2, 3]
    for w in wrappers:
        assert isinstance(w, DataParallel)
        assert isinstance(inspect.getattr_static(type(w), "comm_bytes"), property)
        assert w.comm_bytes == 0.0
    with pytest.raises(RuntimeError, match="synchronises gradients only"):
        wrappers[0].step()


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)  # b gets no gradient


def _unused() -> dict:
    x = torch.full((2, 3), float(dist.get_rank() + 1))
    out = {}
    for stage in STAGES:
        with pytest.raises(RuntimeError, match=r"2 parameter\(s\) received no gradient .*\['b\."):
            _wrap(stage, _Branches())(x).sum().backward()
        net = _Branches()
        before = [p.detach().clone() for p in net.b.parameters()]
        w = _wrap(stage, net, find_unused_parameters=True)
        w(x).sum().backward()
        w.step()
        with w.summon_full_params():
            unchanged = all(
                torch.equal(p, q) for p, q in zip(net.b.parameters(), before, strict=True)
            )
            out[stage] = (unchanged, net.a.bias.detach().clone())
    return out


def test_unused_parameters_at_every_stage():
    """Refused by default, naming them; with find_unused_parameters their gradient is zero
    (b does not move) and the rest trains (a's bias: lr x the batch size 2, averaged)."""
    bias = _Branches().a.bias.detach()
    want, want64 = bias - LR * 2.0, bias.double() - LR * 2.0
    for out in run_ranks(_unused, 2):
        for stage, (unchanged, got) in out.items():
            assert unchanged, f"stage {stage}: an unused parameter moved"
            agree(got, want, want64, f"stage {stage}: a.bias", length=2)


SMALL = tiny_config(steps=3, seq_len=32)


@pytest.mark.parametrize(  # (gpt with experts, fp16 too: tests/test_verify_matrix.py)
    "layout",
    [
        dict(
            tp=1,
            pp=2,
            dp=2,
            ep=1,
            zero=3,
            model_type="llama",
            kv_heads=2,
            qk_norm=True,
            moe_every=0,
            schedule="gpipe",
            microbatches=4,
            recompute=True,
        ),
    ],
    ids=["llama-recompute"],
)
def test_zero3_under_a_pipeline_with_tied_embeddings(layout):
    """ZeRO-3 x PP 2 in the trainer: the token embedding (first stage) and the LM head (last
    stage) share one weight, each stage's copy sharded over its DP group; GPipe over 4
    micro-batches with recomputation (MoE blocks and fp16 loss scaling through the engine:
    tests/test_verify_matrix.py)."""
    cfg = TrainConfig.from_flags(**{**SMALL, **layout})
    assert cfg.model.tie_embeddings
    ok, text = compare(cfg)
    assert ok, text


H, M = 6, 2  # width, micro-batches


def _moe_net(aux_in_backward: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    moe = MoE(
        H,
        8,
        4,
        top_k=2,
        capacity_factor=None,
        aux_loss_coef=0.5,
        aux_loss_in_backward=aux_in_backward,
    )
    return nn.Sequential(nn.Linear(H, H), moe, nn.Linear(H, H))


def _engine_aux_weight() -> list:
    """A pipeline of two stages, the MoE on the second; the engine's gradients against the
    whole model's, whose loss adds every micro-batch's auxiliary loss weighted like its main
    loss: scale_loss(loss / M + aux / M), with a loss scale of 8 — by the rule, against the
    whole model in fp32 and in float64 (the engine backpropagates the loss and the aux loss as
    its own sums)."""
    mesh = make_mesh(pp=2)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 3, H, generator=g), torch.randn(4, 3, H, generator=g)
    scale = lambda t: t * 8.0  # noqa: E731
    dense = _moe_net(aux_in_backward=False)  # the aux loss is added to the loss by hand
    dense64 = exact_copy(dense)
    for net in (dense, dense64):
        dtype = next(net.parameters()).dtype
        for xi, yi in zip(x.to(dtype).chunk(M), y.to(dtype).chunk(M), strict=True):
            loss = F.mse_loss(net(xi), yi) / M
            scale(loss + moe_aux_loss(net) / M).backward()
    errors = []
    for recompute, aux in ((False, True), (True, True), (False, False)):
        stage, (lo, hi) = build_stage(list(_moe_net()), 2, mesh.pp_rank, costs=[1, 2, 1])
        engine = PipelineEngine(
            stage,
            mesh,
            GPipe(M),
            loss_fn=F.mse_loss,
            scale_loss=scale,
            recompute=recompute,
            moe_aux_loss=aux,
        )
        engine.train_step(x, y)
        ref, ref64 = (nn.Sequential(*list(net)[lo:hi]) for net in (dense, dense64))
        for (name, p), q, q64 in zip(
            stage.named_parameters(), ref.parameters(), ref64.parameters(), strict=True
        ):
            if aux:  # the longest sum: the 12 tokens
                agree(
                    p.grad, q.grad, q64.grad, f"recompute={recompute}: gradient {name}", length=12
                )
            elif p.grad is not None and q.grad is not None:
                errors.append(float((p.grad - q.grad).abs().max()))
    return errors


def test_the_engine_weighs_moe_aux_losses_like_a_micro_batch_loss():
    """With ``moe_aux_loss=False`` the MoE stage's gradients differ (the aux loss matters)."""
    out = run_ranks(_engine_aux_weight, 2)
    assert max(out[1]) > 1e-3
