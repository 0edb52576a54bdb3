"""``fastpar.checkpoint.gather_grads`` / ``gather_like`` / ``gather_state``: whole tensors on one
rank from any layout.

Every kind of mark, exactly: replicated, sharded along either dim, fused blocks, a padded
vocabulary, experts, a per-head entry one rank owns, a name only one pipeline stage holds —
against global tensors sliced here by hand. Then a real trainer's first-step gradients under
TP x DP, TP x PP with ZeRO-1, EP with ZeRO-2, hybrid-sharded ZeRO-3, CP and TP x SP, gathered and
judged against one device's by the tolerance rule. An error on one rank is raised on every rank
(none left waiting on a collective)."""

from __future__ import annotations

import pytest
import torch
from _flags import tiny_config
from _mesh import make_mesh

from fastpar.checkpoint import CheckpointError, gather_grads, gather_like, gather_state
from fastpar.mesh.placement import mark_expert, mark_owned, mark_sharded
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig


def _global(name: str, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*shape, generator=g, dtype=torch.float64)


GLOBALS = {
    "rep": (5, 3),
    "col": (6, 4),
    "row": (4, 6),
    "qkv": (3 * 4, 5),  # q, k, v blocks of 4 rows, each split over TP
    "vocab": (7, 3),  # 7 rows over 2 ranks: 4 each, the last one padding
    "experts": (4, 3, 2),  # 4 experts over EP 2
    "norms.0": (3,),  # per-head entries: TP rank r owns norms.r
    "norms.1": (3,),
    "stage1": (2, 2),  # held by the last pipeline stage only
}


def _marked_params(mesh) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters, each marked, its .grad its piece of ``_global(name)``, sliced
    by hand (not through the marks)."""
    tp, r = mesh.tp_group, mesh.tp_rank
    out: dict[str, torch.nn.Parameter] = {}

    def param(name: str, local: torch.Tensor) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.zeros_like(local))
        p.grad = local.clone()
        out[name] = p
        return p

    param("rep", _global("rep", *GLOBALS["rep"]))
    mark_sharded(param("col", _global("col", 6, 4).chunk(2, 0)[r]), 0, tp, 6)
    mark_sharded(param("row", _global("row", 4, 6).chunk(2, 1)[r]), 1, tp, 6)
    blocks = _global("qkv", 12, 5).chunk(3, 0)
    mark_sharded(param("qkv", torch.cat([b.chunk(2, 0)[r] for b in blocks])), 0, tp, 12, fused=3)
    vocab = torch.cat([_global("vocab", 7, 3), torch.zeros(1, 3, dtype=torch.float64)])
    mark_sharded(param("vocab", vocab.chunk(2, 0)[r]), 0, tp, 7)
    experts = _global("experts", 4, 3, 2).chunk(2, 0)[mesh.ep_rank]
    mark_expert(param("experts", experts), mesh.ep_group, num_experts=4)
    mark_owned(param(f"norms.{r}", _global(f"norms.{r}", 3)), tp)
    if mesh.is_last_stage:
        param("stage1", _global("stage1", 2, 2))
    return out


def _gather_every_kind() -> dict | None:
    mesh = make_mesh(tp=2, pp=2, ep=2)  # 8 ranks: tp 2 x dp 2 x pp 2, ep 2
    params = _marked_params(mesh)
    got = gather_grads(params, mesh=mesh)
    like = gather_like({n: p.grad * 2 for n, p in params.items()}, params, mesh=mesh)
    if got is None:
        assert like is None
        return None
    return {"grads": got, "like": like}


def test_every_kind_of_mark_gathers_exactly():
    results = run_ranks(_gather_every_kind, 8)
    assert all(r is None for r in results[1:])
    got, like = results[0]["grads"], results[0]["like"]
    assert sorted(got) == sorted(GLOBALS)
    for name, shape in GLOBALS.items():
        want = _global(name, *shape)
        assert torch.equal(got[name], want), name
        assert torch.equal(like[name], 2 * want), name


def _without_mesh() -> dict | None:
    """No mesh: every holder sends; the copies agree, so the result is the same."""
    mesh = make_mesh(tp=2, ep=2)
    return gather_grads(_marked_params(mesh), dst=1)


def test_without_a_mesh_every_copy_is_sent_and_they_agree():
    results = run_ranks(_without_mesh, 4)
    assert results[0] is None and results[2] is None and results[3] is None
    want = {n: _global(n, *s) for n, s in GLOBALS.items()}  # (one stage: every rank is last)
    assert sorted(results[1]) == sorted(want)
    assert all(torch.equal(results[1][n], w) for n, w in want.items())


def _failing(kind: str) -> str:
    mesh = make_mesh(tp=2, ep=2)
    params = _marked_params(mesh)
    if kind == "no grad" and mesh.tp_rank == 1:
        params["col"].grad = None  # half of col never arrives: dst alone would see it
    if kind == "copies differ" and mesh.rank == 3:
        params["rep"].grad += 1.0
    try:
        if kind == "wrong shape":  # through gather_like: torch refuses such a .grad itself
            values = {n: p.grad for n, p in params.items()}
            if mesh.rank == 2:
                values["row"] = torch.zeros(2)
            gather_like(values, params, mesh=mesh)
        gather_grads(params, mesh=None if kind == "copies differ" else mesh)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kind, message",
    [
        ("no grad", r"the ranks' pieces of the gradient of 'col' cover 12 of its 24 elements"),
        ("copies differ", r"two ranks sent different values for the same elements of the gradient"),
        ("wrong shape", r"rank 2: .row.: a value has shape \(2,\), but the parameter"),
    ],
)
def test_an_error_on_one_rank_is_raised_on_every_rank(kind, message):
    """Before: ``gather_state`` raised on the destination alone and left the others waiting
    until their collective timeout."""
    import re

    for rank, text in enumerate(run_ranks(_failing, 4, kind)):
        assert re.search(message, text), f"rank {rank}: {text}"


def _state_of_a_misnamed_pipeline() -> str:
    """Two stages naming their own layers from 0: two tensors under one name, refused."""
    mesh = make_mesh(pp=2)
    w = torch.nn.Parameter(torch.full((2,), float(mesh.pp_rank)))
    try:
        gather_state({"layers.0.w": w}, mesh=mesh)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_two_tensors_under_one_name_are_refused():
    for text in run_ranks(_state_of_a_misnamed_pipeline, 2):
        assert "two tensors under one name" in text, text


# -- a trainer's gradients, judged against one device's ---------------------------------------
def _first_step(cfg: TrainConfig, refs, use_wrapper: bool) -> list[str] | None:
    """This rank's first forward and backward (no optimizer step); the gradients gathered on
    rank 0 and judged there by the tolerance rule against the single-process model's."""
    from _trainer import first_backward

    trainer, mesh = first_backward(cfg)
    wrapper = trainer.model if use_wrapper else None
    full = gather_grads(trainer.named_parameters(), mesh=mesh, wrapper=wrapper)
    if full is None:
        return None
    want = set(refs.exact.grads[0])
    lines = [f"{len(full)} gradients gathered"]
    if set(full) != want:
        lines.append(f"names: missing {sorted(want - set(full))}, extra {sorted(set(full) - want)}")
    lines += [
        str(c) for n, g in full.items() if n in want and not (c := refs.grad(0, n, g.double())).ok
    ]
    return lines


LAYOUTS = {
    "tp2-dp2": (dict(tp=2, pp=1, dp=2, ep=1, moe_every=0, zero=0), False),
    "tp2-dp2-wrapper": (dict(tp=2, pp=1, dp=2, ep=1, moe_every=0, zero=0), True),
    "tp2-pp2-zero1": (dict(tp=2, pp=2, dp=1, ep=1, moe_every=0, zero=1), True),
    "dp2-ep2-moe-zero2": (dict(tp=1, pp=1, dp=2, ep=2, moe_every=1, experts=4, zero=2), True),
    "hsdp-zero3": (dict(tp=1, pp=1, dp=4, ep=1, moe_every=0, zero=3, dp_shard=2), True),
    "cp2-dp2": (dict(tp=1, pp=1, dp=2, cp=2, ep=1, moe_every=0, zero=0), False),
    "tp2-sp-dp2-zero1": (
        dict(tp=2, pp=1, dp=2, ep=1, moe_every=0, zero=1, sequence_parallel=True),
        True,
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_a_trainers_gradients_gather_to_one_devices(layout):
    from fastpar.verify import references

    changes, use_wrapper = LAYOUTS[layout]
    cfg = TrainConfig.from_flags(**tiny_config(**changes, steps=1))
    cfg.check()
    refs = references(cfg, None)
    results = run_ranks(_first_step, cfg.world_size, cfg, refs, use_wrapper)
    lines = results[0]
    assert all(r is None for r in results[1:])
    assert int(lines[0].split()[0]) == len(refs.exact.grads[0]) > 0, lines
    assert len(lines) == 1, "\n".join(lines)
