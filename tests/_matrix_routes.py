"""The verification matrix's check of every router's choice of every token against the float64
run's (tests/_matrix.py's ``verify``; docs/tolerances.md, "A router's near tie")."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

# -- every router's choice against the float64 run's --------------------------------------------
# A token whose two best experts score within rounding of each other (a near tie) may go to
# either: in bf16 / fp16 the rounding of the router's input (2^-8, 2^-11 of it) moves a score by
# 1e-3 and more, and FASTPAR_TEST_SEED=3 drew a token two experts scored 2.7e-5 apart in
# float64 (gpt-moe-fp16-muonheads-tp2sp-z2-ep2-ring, step 1). A flipped token's share of the
# expert, router and upstream gradients moves by percents of the value, which the rule's bound
# (rounding) does not allow, and the run would DISAGREE while correct. So the matrix compares
# every rank's top-k choice of every token with the float64 run's: a token routed otherwise by
# a score gap within rounding (``tie_bound``) is a near tie and takes the float64 run's choice,
# reported; one routed otherwise beyond rounding is a defect (DISAGREE), as is a router input
# that matches no token of the float64 run within rounding. Every gradient is judged after it.
_routes: dict = {}
_capture: dict = {}  # the running trainer's step, its routing events (_matrix.gradients)


def _selection(router, probs: torch.Tensor) -> torch.Tensor:
    """What ``router`` picks its top-k by: its scores, plus the expert bias."""
    sel = probs.detach()
    if router.expert_bias is not None:
        sel = sel + router.expert_bias.to(sel.dtype)
    return sel


@contextlib.contextmanager
def recording_routes(store: dict):
    """While inside: every training-mode router call of the single-process references
    (``fastpar.verify.reference``: the run, its twin, float64) appends (router input, selection
    scores, expert ids) to ``store[(run, step, router weight's name)]``."""
    import fastpar.verify as verify_module
    from fastpar.moe.router import TopKRouter

    real = (verify_module.reference, verify_module.build, verify_module.batch_of)
    real_forward = TopKRouter.forward
    now: dict = {}

    def reference(cfg, tokens=None, *, exact=False, twin=False, skips=()):
        now.update(run="exact" if exact else "twin" if twin else "single", step=None)
        try:
            return real[0](cfg, tokens, exact=exact, twin=twin, skips=skips)
        finally:
            now.clear()

    def build(*args, **kwargs):
        parts = real[1](*args, **kwargs)
        now["names"] = {id(p): n for n, p in parts.named_parameters().items()}
        return parts

    def batch_of(cfg, data, step, *args, **kwargs):
        now["step"] = step
        return real[2](cfg, data, step, *args, **kwargs)

    def forward(self, x, seq_len=None, valid=None):
        r = real_forward(self, x, seq_len, valid)
        if now.get("step") is not None and self.training and torch.is_grad_enabled():
            key = (now["run"], now["step"], now["names"][id(self.weight)])
            sel = _selection(self, r.router_probs).double()
            store.setdefault(key, []).append((x.detach().double(), sel, r.expert_ids.clone()))
        return r

    verify_module.reference, verify_module.build, verify_module.batch_of = (
        reference,
        build,
        batch_of,
    )
    TopKRouter.forward = forward
    try:
        yield
    finally:
        verify_module.reference, verify_module.build, verify_module.batch_of = real
        TopKRouter.forward = real_forward


@dataclasses.dataclass
class RouteTable:
    """One router at one step of the float64 run, every token of the global batch: its input
    ``x`` [N, H], selection scores ``sel`` [N, E] and choice ``ids`` [N, k]; ``radius``: how far
    (L2) a correct run's router input may lie from it; ``tie``: how far apart two experts' scores
    may be for rounding to swap them (``tie_bound``); ``flips``: tokens the single-process run
    and its twin routed otherwise than float64."""

    x: torch.Tensor
    sel: torch.Tensor
    ids: torch.Tensor
    radius: float
    tie: float
    flips: dict


def _sets(ids: torch.Tensor) -> list[frozenset]:
    return [frozenset(r.tolist()) for r in ids]


def tie_bound(runs, exact: torch.Tensor, dtype: torch.dtype, length: int) -> float:
    """The rule's bound on one score (``fastpar.tolerance``), over all of them: ``FACTOR`` x
    the largest error of the single-process runs' scores against float64, plus the floor."""
    from fastpar import tolerance

    err = max(tolerance.max_error(r, exact) for r in runs)
    return tolerance.FACTOR * err + tolerance.floor(dtype, length, tolerance.magnitude(exact))


def route_tables(store: dict, dtype: torch.dtype, length: int) -> dict:
    """``recording_routes``' records as {(step, name): RouteTable}."""
    from fastpar import tolerance

    tables = {}
    for (run, step, name), calls in store.items():
        if run != "exact":
            continue
        x, sel, ids = (torch.cat(part) for part in zip(*calls, strict=True))
        others = {
            r: [torch.cat(p) for p in zip(*store[(r, step, name)], strict=True)]
            for r in ("single", "twin")
        }
        dist_x = max(float((o[0] - x).norm(dim=1).max()) for o in others.values())
        scale = float(x.norm(dim=1).max())
        radius = tolerance.FACTOR * dist_x + tolerance.floor(dtype, length, scale)
        tie = tie_bound([o[1] for o in others.values()], sel, dtype, length)
        flips = {
            r: sum(a != b for a, b in zip(_sets(o[2]), _sets(ids), strict=True))
            for r, o in others.items()
        }
        tables[(step, name)] = RouteTable(x, sel, ids, radius, tie, flips)
    return tables


def _choice(router, sel: torch.Tensor) -> frozenset:
    """The experts ``router`` picks by the selection scores ``sel`` [E] of one token."""
    from fastpar.moe import balance

    if router.num_groups is None:
        ids = torch.topk(sel, router.top_k).indices
    else:
        ids = balance.group_limited_topk(
            sel[None],
            router.top_k,
            router.num_groups,
            router.group_topk,
            router.group_score_topk,
        )[0]
    return frozenset(ids.tolist())


def swap_distance(router, sel: torch.Tensor, choice: frozenset) -> float:
    """The least d such that moving each of the float64 run's selection scores ``sel`` [E] by
    at most d (``choice``'s experts up, the others down) makes ``router`` pick ``choice``: half
    the score gap for a plain top-k, a group's gap too when group-limited (bisection)."""
    sel = sel.detach()
    if _choice(router, sel) == choice:
        return 0.0
    sign = torch.full_like(sel, -1.0)
    sign[sorted(choice)] = 1.0
    lo, hi = 0.0, float(sel.max() - sel.min()) + 1.0
    if _choice(router, sel + hi * sign) != choice:
        return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _choice(router, sel + mid * sign) == choice else (mid, hi)
    return hi


@contextlib.contextmanager
def routes(tables: dict):
    """While inside: every router of a rank forked from this process (inside ``gradients``,
    which names its steps and routers) compares its choice of each token with the float64
    run's (``tables``, ``route_tables``): the token matched by its router input (the nearest of
    the float64 run's at that step, within ``radius``; tokens of the same input within it are
    one); a choice otherwise by a score gap within ``tie`` takes the float64 run's ids (a near
    tie), beyond it stays (a defect). Events go to ``_capture["routing"]`` (``judge_routing``)."""
    from fastpar.moe.router import TopKRouter

    real = TopKRouter.forward

    def forward(self, x, seq_len=None, valid=None):
        r = real(self, x, seq_len, valid)
        if not (self.training and torch.is_grad_enabled() and "trainer" in _capture):
            return r
        name = _routes["names"][id(self.weight)]
        table = tables.get((_capture["step"], name))
        if table is None:
            _capture["routing"].append(("unknown", _capture["step"], name, x.shape[0]))
            return r
        return _pin(self, r, x, valid, table, name)

    TopKRouter.forward = forward
    try:
        yield
    finally:
        TopKRouter.forward = real
        _routes.clear()


def _pin(router, r, x: torch.Tensor, valid, table: RouteTable, name: str):
    """``r`` with each near tie routed as the float64 run (``routes``)."""
    step, events = _capture["step"], _capture["routing"]
    d = torch.cdist(x.detach().double(), table.x)
    near, j = d.min(dim=1)
    mine, theirs = _sets(r.expert_ids), _sets(table.ids[j])
    pinned = r.expert_ids.clone()
    for t in range(x.shape[0]):
        if near[t] > table.radius:
            events.append(("unmatched", step, name, float(near[t]), table.radius))
            continue
        if mine[t] == theirs[t]:
            continue
        same = (d[t] <= near[t] + table.radius).nonzero().flatten()  # one input, within rounding
        if any(_sets(table.ids[s : s + 1])[0] == mine[t] for s in same.tolist()):
            continue
        gap = swap_distance(router, table.sel[j[t]], mine[t])
        if gap > table.tie:
            events.append(
                ("beyond", step, name, sorted(mine[t]), sorted(theirs[t]), gap, table.tie)
            )
            continue
        events.append(("tie", step, name, sorted(mine[t]), sorted(theirs[t]), gap, table.tie))
        own = _selection(router, r.router_probs)[t]
        ids = table.ids[j[t]].to(pinned.device)
        pinned[t] = ids[own[ids].argsort(descending=True)]
    events.append(("tokens", step, name, x.shape[0]))
    if torch.equal(pinned, r.expert_ids):
        return r
    if router.expert_bias is not None:  # the counts the trainer's bias step reads
        ones = torch.ones(pinned.numel(), dtype=torch.int64, device=pinned.device)
        if valid is not None:
            ones = valid.to(pinned.device).repeat_interleave(router.top_k).to(torch.int64)
        router.tokens_per_expert.index_add_(0, r.expert_ids.reshape(-1), -ones)
        router.tokens_per_expert.index_add_(0, pinned.reshape(-1), ones)
    probs = r.router_probs.gather(1, pinned)
    order = None
    if router.drop_policy != "position":
        ranked = probs if router.drop_policy == "probs" else router._topk_weights(probs)
        order = torch.sort(ranked.t().reshape(-1), descending=True, stable=True).indices
    return dataclasses.replace(r, expert_ids=pinned, probs=probs, order=order)


#: how many near ties and how many defects ``judge_routing`` names (it counts them all)
SHOWN = 10


def judge_routing(tables: dict, events: list) -> tuple[bool, list[str]]:
    """``routes``' events: agree unless a token was routed otherwise beyond rounding, matched
    no float64 token or a router was not in the float64 run; the near ties named."""
    tokens = sum(e[3] for e in events if e[0] == "tokens")
    ties = [e for e in events if e[0] == "tie"]
    bad = [e for e in events if e[0] in ("beyond", "unmatched", "unknown")]
    lines = [
        f"{tokens} routed tokens against float64's choice: {len(ties)} near ties routed as "
        f"float64, {len(bad)} otherwise beyond rounding or unmatched"
    ]
    shown = ties[:SHOWN] + bad[:SHOWN]
    for kind, step, name, *rest in shown:
        if kind in ("tie", "beyond"):
            mine, theirs, gap, tie = rest
            verdict = "a near tie, routed as float64" if kind == "tie" else "beyond rounding"
            lines.append(
                f"{name} (step {step + 1}): {verdict}: a token to experts {mine} for float64's "
                f"{theirs}: float64's scores moved by {gap:.3g} each pick them, rounding moves "
                f"a score by up to {tie:.3g}{'' if kind == 'tie' else ' -- DISAGREE'}"
            )
        elif kind == "unmatched":
            lines.append(
                f"{name} (step {step + 1}): a router input {rest[0]:.3g} from every float64 "
                f"token's (rounding: {rest[1]:.3g}) -- DISAGREE"
            )
        else:
            lines.append(f"{name} (step {step + 1}): no float64 router of that name -- DISAGREE")
    if len(ties) + len(bad) > len(shown):
        lines.append(f"(and {len(ties) + len(bad) - len(shown)} more)")
    for (step, name), t in sorted(tables.items()):
        for run, n in t.flips.items():
            if n:
                lines.append(
                    f"(the single-process {run} routed {n} token(s) of {name} at step {step + 1} "
                    "otherwise than float64: its gradients' bound there is the looser)"
                )
    return not bad, lines
