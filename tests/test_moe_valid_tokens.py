"""MoE auxiliary statistics over valid tokens only (``Documents.valid`` / ``MoE(x, valid=)`` /
``TopKRouter(x, valid=)``): the load-balancing losses ("micro_batch", "sequence"), the z-loss
and the expert-bias counts count only the tokens whose target is valid; routing is unchanged.

* masked "micro_batch" + z-loss == the same router's losses on the valid tokens' rows alone;
* masked "sequence" + z-loss == a float64 computation from the docstrings' definitions;
* a micro-batch without a valid token: aux 0, finite gradients;
* no mask: bit for bit the unmasked formulas (the behaviour before masking existed);
* expert-bias counts: the valid tokens' choices only;
* 2 gloo ranks (TP2 sequence-parallel tokens, TP2 SP + expert TP, CP2, EP2): the masked aux
  loss and expert-bias counts equal the single-process masked ones.
"""

from __future__ import annotations

import pytest
import torch

from fastpar.models.documents import Documents, current, documents
from fastpar.moe import MoE, TopKRouter
from fastpar.testing import run_ranks

H, FFN, E, K, B, S = 8, 8, 4, 2, 3, 8

ROUTINGS = {
    "softmax": dict(),
    "deepseek": dict(score="sigmoid", num_groups=2, group_topk=1, expert_bias=True),
}


def _moe(routing="softmax", aux_loss="micro_batch", capacity=None, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(
        H,
        FFN,
        E,
        K,
        capacity_factor=capacity,
        min_capacity=None,
        aux_loss=aux_loss,
        aux_loss_coef=0.3,
        z_loss_coef=0.1,
        **ROUTINGS[routing],
        **kw,
    )
    if moe.router.expert_bias is not None:  # a bias that changes the choice
        moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return moe


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g)
    x[:, : S // 2] += 1.0
    valid = torch.rand(B, S, generator=g) > 0.4
    valid[0, :3] = False  # a prompt
    valid[1] = False  # a row without a valid target
    valid[2, -1] = False  # a packed document's last token
    ids = torch.zeros(B, S, dtype=torch.int64)
    return x, valid, ids


def _aux(moe: MoE, x, valid=None, via="documents") -> torch.Tensor:
    moe.aux_loss_in_backward = False
    if via == "documents" and valid is not None:
        with documents(Documents.of(torch.zeros(valid.shape, dtype=torch.long), valid=valid)):
            moe(x)
    else:
        moe(x, valid=valid)
    return moe.aux_loss


def _losses_on(router: TopKRouter, tokens: torch.Tensor, seq_len=None):
    """The existing, unmasked code's (balance, z) on these tokens."""
    r = router(tokens, seq_len=seq_len)
    counts = torch.bincount(r.expert_ids.reshape(-1), minlength=E)
    return router.aux_losses(r, counts)


# -- (a) masked == the losses of the valid tokens alone / of the definitions ----------------
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("capacity", [None, 1.0])
@pytest.mark.parametrize("via", ["documents", "argument"])
def test_micro_batch_and_z_loss_equal_those_of_the_valid_rows_alone(routing, capacity, via):
    moe = _moe(routing, capacity=capacity).eval()
    x, valid, _ = _data()
    with torch.no_grad():
        got = _aux(moe, x, valid, via)
        bal, z = _losses_on(moe.router, x.reshape(-1, H)[valid.reshape(-1)])
        r = moe.router(x.reshape(-1, H), valid=valid.reshape(-1))
        got_bal, got_z = moe.router.aux_losses(r, torch.zeros(E))  # counts: from the valid ids
    assert z > 0 and bal > 0
    torch.testing.assert_close(got, bal + z, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_bal, bal, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_z, z, rtol=1e-6, atol=1e-7)


def _definition_sequence_loss(moe: MoE, x: torch.Tensor, valid: torch.Tensor, sigmoid: bool):
    """float64, from the router docstring: per sequence, f_i = the fraction of its valid tokens'
    k choices sent to expert i, P_i = the mean over its valid tokens of the (normalised)
    scores; coef · E · Σ f_i P_i averaged over the sequences holding a valid token; z-loss
    coef · mean over the valid tokens of logsumexp(logits)²."""
    r = moe.router
    w = r.weight.detach().double()
    logits = x.double() @ w.t()  # [B, S, E]
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
    p = scores / scores.sum(-1, keepdim=True) if sigmoid else scores
    with torch.no_grad():
        ids = r(x.reshape(-1, H)).expert_ids.reshape(B, S, K)  # the routing (not masked)
    per_seq = []
    for b in range(B):
        rows = [s for s in range(S) if valid[b, s]]
        if not rows:
            continue
        f = torch.zeros(E, dtype=torch.float64)
        for s in rows:
            for j in range(K):
                f[ids[b, s, j]] += 1.0
        f /= len(rows) * K
        pbar = p[b, rows].mean(0)
        per_seq.append(r.aux_loss_coef * E * float((f * pbar).sum()))
    bal = sum(per_seq) / len(per_seq)
    lse = torch.logsumexp(logits, -1)[valid]
    z = r.z_loss_coef * float(lse.square().mean())
    return bal, z


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_sequence_loss_equals_the_definition_over_valid_tokens(routing):
    moe = _moe(routing, aux_loss="sequence").eval()
    x, valid, _ = _data()
    bal, z = _definition_sequence_loss(moe, x, valid, routing == "deepseek")
    with torch.no_grad():
        got = _aux(moe, x, valid)
        r = moe.router(x.reshape(-1, H), seq_len=S, valid=valid.reshape(-1))
        got_bal, got_z = moe.router.aux_losses(r, torch.zeros(E))
    assert float(got_bal) == pytest.approx(bal, rel=1e-5)
    assert float(got_z) == pytest.approx(z, rel=1e-5)
    assert float(got) == pytest.approx(bal + z, rel=1e-5)
    # the sequence without a valid token is left out of the average, not counted as 0
    with torch.no_grad():
        r_all = moe.router(x.reshape(-1, H), seq_len=S)
        unmasked = float(moe.router.aux_losses(r_all, torch.zeros(E))[0])
    assert float(got_bal) != pytest.approx(unmasked, rel=1e-3)


# -- (b) no valid token ---------------------------------------------------------------------
@pytest.mark.parametrize("aux_loss", ["micro_batch", "sequence"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_a_micro_batch_without_valid_tokens_gives_zero_and_finite_gradients(aux_loss, routing):
    moe = _moe(routing, aux_loss=aux_loss).train()
    x, _, _ = _data()
    x.requires_grad_()
    none = torch.zeros(B, S, dtype=torch.bool)
    with documents(Documents.of(torch.zeros(B, S, dtype=torch.long), valid=none)):
        y = moe(x)  # the aux loss enters backward through y (scale 1)
    assert float(moe.aux_loss) == 0.0
    y.square().sum().backward()
    for name, p in [("x", x), *moe.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # differentiable path: the aux loss alone has zero, finite gradients
    moe.zero_grad(set_to_none=True)
    aux = _aux(moe, x.detach(), none)
    assert float(aux.detach()) == 0.0 and aux.requires_grad
    aux.backward()
    g = moe.router.weight.grad
    assert g is not None and torch.isfinite(g).all() and not g.any()
    if moe.router.expert_bias is not None:
        assert not moe.router.tokens_per_expert.any()  # nothing counted


# -- (c) no mask: unchanged -----------------------------------------------------------------
@pytest.mark.parametrize("aux_loss", ["micro_batch", "sequence"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_no_mask_is_the_unmasked_computation_bit_for_bit(aux_loss, routing):
    moe = _moe(routing, aux_loss=aux_loss).eval()
    x, _, _ = _data()
    with torch.no_grad():
        plain = _aux(moe, x)
        with documents(Documents.of(torch.zeros(B, S, dtype=torch.long))):  # no valid
            moe(x)
        in_docs = moe.aux_loss
        # the formulas as they were before masking, on every token
        r = moe.router(x.reshape(-1, H), seq_len=S)
        p = r.router_probs
        if routing == "deepseek":
            p = p / (p.sum(-1, keepdim=True) + 1e-20)
        counts = torch.bincount(r.expert_ids.reshape(-1), minlength=E)
        coef = moe.router.aux_loss_coef
        if aux_loss == "micro_batch":
            f = counts.to(torch.float32) / (B * S * K)
            bal = coef * E * (f * p.mean(dim=0)).sum()
        else:
            c = torch.zeros(B, E).scatter_add_(
                1, r.expert_ids.reshape(B, S * K), torch.ones(B, S * K)
            )
            bal = coef * E * ((c / (S * K)) * p.reshape(B, S, E).mean(1)).sum(-1).mean()
        z = moe.router.z_loss_coef * torch.logsumexp(r.logits, -1).square().mean()
        every = _aux(moe, x, torch.ones(B, S, dtype=torch.bool))
    assert torch.equal(plain, bal + z)
    assert torch.equal(in_docs, plain)
    torch.testing.assert_close(every, plain, rtol=1e-6, atol=1e-7)  # all valid: the same value


# -- (d) expert-bias counts -----------------------------------------------------------------
def test_expert_bias_counts_count_valid_tokens_only():
    moe = _moe("deepseek").train()
    x, valid, _ = _data()
    with documents(Documents.of(torch.zeros(B, S, dtype=torch.long), valid=valid)):
        moe(x).sum().backward()
    with torch.no_grad():
        ids = moe.router(x.reshape(-1, H)).expert_ids
    want = torch.bincount(ids[valid.reshape(-1)].reshape(-1), minlength=E)
    assert torch.equal(moe.router.tokens_per_expert, want)
    assert int(want.sum()) == int(valid.sum()) * K
    moe.router.tokens_per_expert.zero_()
    moe(x).sum().backward()  # no documents: every token
    assert torch.equal(moe.router.tokens_per_expert, torch.bincount(ids.reshape(-1), minlength=E))


# -- documents and layouts ------------------------------------------------------------------
def test_documents_carry_valid_through_of_and_rows():
    ids = torch.zeros(4, 5, dtype=torch.int32)
    valid = torch.rand(4, 5) > 0.5
    d = Documents.of(ids, valid=valid)
    assert d.valid is valid and d.ids.dtype == torch.int64
    assert torch.equal(d.rows(slice(1, 3)).valid, valid[1:3])
    assert torch.equal(d.rows(torch.tensor([0, 3])).valid, valid[[0, 3]])
    assert Documents.of(ids).valid is None and Documents.of(ids).rows(slice(0, 1)).valid is None
    assert Documents.of(ids, False).reset_positions is False
    with pytest.raises(ValueError, match="bool"):
        Documents.of(ids, valid=valid.long())
    with pytest.raises(ValueError, match=r"\(4, 5\)"):
        Documents.of(ids, valid=valid[:, :4])
    assert current() is None


def test_flat_and_sequence_first_inputs_line_the_mask_up_and_mismatches_are_refused():
    moe = _moe().eval()
    x, valid, _ = _data()
    with torch.no_grad():
        want = _aux(moe, x, valid)
        flat = _aux(moe, x.reshape(-1, H), valid)  # [B·S, H]: batch-first rows flattened
        seq_first = _moe(sequence_dim=0).eval()
        got_sf = _aux(seq_first, x.transpose(0, 1).contiguous(), valid)
    torch.testing.assert_close(flat, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_sf, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="whole rows"):
        _aux(moe, x[:2], valid)  # another micro-batch's rows
    with pytest.raises(ValueError, match="bool mask over the input's tokens"):
        moe(x, valid=valid[:, :4])


# -- (e) two ranks --------------------------------------------------------------------------
def _two_ranks(layout: str):
    import torch.distributed as dist
    from _mesh import make_mesh

    from fastpar.parallel.context import split_sequence

    mesh = make_mesh(
        **({"cp": 2} if layout == "cp2" else {"ep": 2} if layout == "ep2" else {"tp": 2})
    )
    rank = dist.get_rank()
    out = {}
    for aux_loss in ("micro_batch", "sequence"):
        kw = dict(sequence_parallel=layout.startswith("sp"), expert_tp=layout == "sp+etp")
        moe = _moe("deepseek", aux_loss=aux_loss, mesh=mesh, **kw).train()
        ref = _moe("deepseek", aux_loss=aux_loss).train()
        seed = 1 + (rank if layout == "ep2" else 0)  # ep2: each rank its own batch
        x, valid, ids = _data(seed)
        with documents(Documents.of(ids, valid=valid)):
            (ref(x) * 0).sum().backward()  # the aux loss reaches backward by itself
            local = x
            if layout == "cp2":
                local = split_sequence(x, mesh.cp_group, dim=1)
            elif layout.startswith("sp"):
                local = x.chunk(2, dim=1)[mesh.tp_rank]
            (moe(local) * 0).sum().backward()
        out[aux_loss] = (float(moe.aux_loss), float(ref.aux_loss))
        if layout.startswith("sp"):  # the explicit mask, over this rank's own tokens
            mask = valid.chunk(2, dim=1)[mesh.tp_rank]
            moe.aux_loss_in_backward = False
            with torch.no_grad():
                moe(local, valid=mask)
            out[aux_loss + "/argument"] = (float(moe.aux_loss), float(ref.aux_loss))
        counts = moe.router.tokens_per_expert.clone()
        if layout in ("sp", "cp2"):  # each rank routed its share of the tokens
            dist.all_reduce(counts)
        out[aux_loss + "/counts"] = (counts.tolist(), ref.router.tokens_per_expert.tolist())
    if layout == "sp":
        moe = _moe(mesh=mesh, sequence_parallel=True)
        with documents(Documents.of(ids, valid=valid)):
            try:
                moe(local.reshape(-1, H))
            except ValueError as e:
                out["error"] = str(e)
    return out


@pytest.mark.parametrize("layout", ["sp", "sp+etp", "cp2", "ep2"])
def test_two_ranks_masked_aux_equals_the_single_process_one(layout):
    for rank, out in enumerate(run_ranks(_two_ranks, 2, layout)):
        error = out.pop("error", None)
        assert (error is not None) == (layout == "sp")
        assert error is None or "cannot line Documents.valid" in error
        for key, (got, want) in out.items():
            if key.endswith("/counts"):
                assert got == want, (rank, key)
            else:
                assert want > 0 and got == pytest.approx(want, rel=1e-5), (rank, key)
