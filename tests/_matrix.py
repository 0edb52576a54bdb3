"""The verification matrix: layout x model x feature cases that prove the trainer equal to one
device, generated from one table (``TABLE``) as a strength-2 covering array (``_covering``):
every pair of levels of two factors that some valid run can hold is in at least one case.

A row is valid when ``TrainConfig.check()`` (and the optimizer's build-time check) accepts its
run, the world has at most ``MAX_WORLD`` ranks, no level is vacuous in it (``VACUOUS``: a
router option without MoE blocks, expert TP without TP) and it is not a known bug
(``KNOWN_BUGS``). The matrix also holds every layout of ``SEEDS``. Each case runs
``fastpar.verify`` (losses, gradient norms and every final parameter by the tolerance rule)
and judges every rank's reduced gradient of every parameter at every step by the same rule
(``gradients``), after checking every router's top-k choice of every token against the float64
run's (``routes``: a near tie takes float64's choice and is named; a choice otherwise beyond
rounding DISAGREEs).
The cases are ordered so that those sharing their single-process references
(``fastpar.verify.reference_key``) run one after the other, from a ``ReferenceCache``.

    python tests/_matrix.py            # the cases, their pair coverage and the excluded pairs
    python tests/_matrix.py --write    # tests/verify_matrix.txt, after a change of the table

Compile is not a factor: a compiled case costs 25-80 s here (inductor, each rank), and
covering its pairs would take at least five of them; ``COMPILED`` turns it on for one case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import os
import sys
import tempfile

import torch

from fastpar.launch import pool

if __package__ in (None, ""):  # python tests/_matrix.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _covering import Coverage, Factor, Row, covering, row_pairs
from _flags import DEEPSEEK_STYLE, tiny_config
from _matrix_routes import _capture, _routes, judge_routing, recording_routes, route_tables, routes

from fastpar.train import TrainConfig

#: every case: a small model, 3 steps of a global batch of 8 sequences of 16 tokens
BASE = tiny_config(steps=3, microbatches=2)
#: DeepSeek-style routing on the MoE blocks (test_moe_tp's flags)
DEEPSEEK_ROUTING = DEEPSEEK_STYLE
MAX_WORLD = 8
#: a group of rows sharing their references goes on while each row covers this many new pairs
MIN_GAIN = 16

#: factor -> level -> the TrainConfig fields it sets; the first level of each is its plain one
#: (left out of the case's id)
TABLE: dict[str, dict[str, dict]] = {
    # what the single-process references depend on (``REFERENCE``) ...
    "model": {
        "gpt": dict(model_type="gpt"),
        "llama": dict(model_type="llama", kv_heads=2, qk_norm=True),  # GQA, Qwen3's q/k norm
        "deepseek": dict(model_type="deepseek"),  # MLA; block 0 dense, MoE after it
    },
    "experts": {"dense": dict(moe_every=0), "moe": dict()},  # moe: the model's MoE blocks
    "router": {
        "softmax": dict(),  # top-2 softmax, dropless, the micro-batch aux loss
        "capacity": dict(capacity_factor=2.0),  # tokens dropped per micro-batch
        "deepseek": DEEPSEEK_ROUTING,
    },
    "precision": {"fp32": dict(), "bf16": dict(precision="bf16"), "fp16": dict(precision="fp16")},
    "optimizer": {
        "adamw": dict(),
        "bf16state": dict(optimizer_state_dtype="bf16"),
        "muon": dict(optimizer="muon"),
        "muonheads": dict(optimizer="muon", muon_per_head=True),
    },
    "documents": {"stream": dict(), "docs": dict(eos_id=10)},  # newline ends a document
    "mtp": {"mtp0": dict(), "mtp1": dict(mtp_depth=1)},
    "loss": {"ce": dict(), "fusedce": dict(fused_ce=True)},
    # ... and the layout
    "tp": {"tp1": dict(tp=1), "tp2": dict(tp=2), "tp2sp": dict(tp=2, sequence_parallel=True)},
    "pp": {
        "pp1": dict(pp=1),
        "1f1b": dict(pp=2, schedule="1f1b"),
        "gpipe": dict(pp=2, schedule="gpipe"),
        "interleaved": dict(pp=2, schedule="interleaved", virtual_stages=2),
        "zb-h1": dict(pp=2, schedule="zb-h1"),
    },
    "dp": {"dp1": dict(dp=1), "dp2": dict(dp=2), "hsdp": dict(dp=4, dp_shard=2, dp_replicate=2)},
    "zero": {"z0": dict(zero=0), "z1": dict(zero=1), "z2": dict(zero=2), "z3": dict(zero=3)},
    "ep": {
        "ep1": dict(ep=1),
        "ep2": dict(ep=2),
        "ep2etp": dict(ep=2, moe_expert_tp=True),  # each expert's FFN split over TP too
    },
    "cp": {"cp1": dict(cp=1), "ring": dict(cp=2), "a2a": dict(cp=2, cp_attention="all-to-all")},
    "recompute": {
        "none": dict(),
        "full": dict(recompute=True),
        "attn": dict(recompute="attention"),
    },
}
REFERENCE = ("model", "experts", "router", "precision", "optimizer", "documents", "mtp", "loss")
"""The factors the references depend on: the matrix's rows come in groups that share them."""

#: the level each factor's partial rows are completed with first: the most permissive
SAFE = {"model": "llama", "experts": "moe", "dp": "dp2", "zero": "z1"}

FACTORS = [Factor(name, tuple(levels), SAFE.get(name, "")) for name, levels in TABLE.items()]


LAYOUT = ("tp", "pp", "dp", "ep", "cp", "zero")
#: layouts the matrix holds whatever else it needs (the generator picks the rest of each row):
#: those of the hand-written verify cases it replaced (python -m fastpar.train's default first)
SEEDS = [
    dict(zip(LAYOUT, layout.split(), strict=True))
    for layout in (
        "tp2 1f1b dp2 ep2 cp1 z1",
        "tp2 gpipe dp2 ep2 cp1 z0",
        "tp2sp pp1 dp2 ep2 cp1 z1",
        "tp2 pp1 dp2 ep2etp cp1 z1",
        "tp2 interleaved dp2 ep2 cp1 z1",
        "tp2 pp1 dp2 ep1 cp1 z1",
        "tp2 1f1b dp2 ep1 cp1 z3",
        "tp1 1f1b dp2 ep2 cp1 z3",
        "tp2 zb-h1 dp1 ep1 cp1 z0",
        "tp1 zb-h1 dp2 ep2 cp1 z1",
        "tp2 pp1 dp2 ep1 ring z1",
        "tp1 1f1b dp1 ep1 ring z1",
        "tp1 1f1b dp2 ep1 ring z1",
        "tp2sp pp1 dp1 ep2 ring z2",
        "tp1 zb-h1 dp1 ep1 ring z0",
        "tp1 interleaved dp1 ep1 ring z1",
        "tp1 gpipe dp2 ep1 cp1 z2",
        "tp1 pp1 hsdp ep1 cp1 z3",
        "tp1 1f1b hsdp ep2 cp1 z3",
        "tp2sp pp1 hsdp ep1 cp1 z1",
        "tp1 interleaved hsdp ep1 cp1 z1",
        "tp1 zb-h1 hsdp ep1 cp1 z2",
        "tp1 gpipe hsdp ep1 cp1 z3",
        "tp2 pp1 dp1 ep1 cp1 z0",
        "tp1 pp1 dp2 ep1 cp1 z1",
        "tp1 pp1 dp2 ep1 cp1 z3",
        "tp2 pp1 dp2 ep2 cp1 z1",
        "tp2 1f1b dp2 ep1 cp1 z1",
        "tp2 1f1b dp2 ep2 cp1 z3",
        "tp2 1f1b dp2 ep2 cp1 z0",
    )
]


def _vacuous(row: Row) -> str | None:
    if row["experts"] == "dense" and row["router"] != "softmax":
        return f"router {row['router']} without MoE blocks is the dense model"
    if row["experts"] == "dense" and row["ep"] != "ep1":
        return f"{row['ep']} without MoE blocks is ep1"
    if row["ep"] == "ep2etp" and row["tp"] == "tp1":
        return "expert TP at tp 1 splits nothing"
    return None


VACUOUS = _vacuous
"""A level that means nothing in its row (the run would be another row's): a refusal of ours."""


def KNOWN_BUGS(row: Row) -> str | None:
    """Why ``row`` is a run the trainer accepts but cannot do yet ("known bug: ..."), None: none
    today (the two there were are fixed: test_verify_matrix.test_the_bugs_once_known_are_gone).
    A new one comes with a test that it still fails."""
    return None


def config(row: Row, **extra) -> TrainConfig:
    """The run of ``row``: ``BASE``, each level's fields, then ``extra``."""
    fields = dict(BASE)
    for name, level in row.items():
        fields.update(TABLE[name][level])
    return TrainConfig.from_flags(**{**fields, **extra})


def refusal(row: Row) -> str | None:
    """Why ``row`` is not a run to verify (None: it is): a vacuous level, a known bug, more
    than ``MAX_WORLD`` ranks, or the trainer's own refusal (``TrainConfig.check``; Muon's
    per-head check at build)."""
    from fastpar.train.optimizers import check_per_head

    why = VACUOUS(row) or KNOWN_BUGS(row)
    if why is not None:
        return why
    cfg = config(row)
    if cfg.world_size > MAX_WORLD:
        return f"world {cfg.world_size} > {MAX_WORLD} ranks"
    try:
        cfg.check()
        check_per_head(cfg)
    except ValueError as exc:
        return str(exc)
    return None


@functools.cache
def matrix(min_gain: int = MIN_GAIN) -> Coverage:
    """The covering array of ``FACTORS`` (computed once a process), its rows in groups that
    share their references (``REFERENCE``, ``same_references``)."""
    return covering(
        FACTORS,
        refusal,
        shared=REFERENCE,
        same=same_references,
        min_gain=min_gain,
        seeds=SEEDS,
    )


def reference_key(row: Row) -> tuple:
    """``fastpar.verify.reference_key`` of ``row``'s run, for grouping and ordering the cases:
    the data are the embedded corpus for every row (their fields, in the key, say how it is
    cut), so a one-element stand-in takes their fingerprint's place (remembered)."""
    return _key(tuple(row.items()))


@functools.cache
def _key(items: tuple) -> tuple:
    from fastpar.verify import reference_key as key

    return key(config(dict(items)), torch.zeros(1))


def same_references(a: Row, b: Row) -> bool:
    return reference_key(a) == reference_key(b)


def case_id(row: Row) -> str:
    """The levels of ``row`` that are not their factor's first, joined: ``llama-tp2sp-...``."""
    plain = {name: next(iter(levels)) for name, levels in TABLE.items()}
    parts = [row["model"]] + [v for k, v in row.items() if k != "model" and v != plain[k]]
    return "-".join(parts)


def generate() -> list[Row]:
    """The matrix's rows (``matrix()``), those sharing their references (``reference_key``)
    one after the other (groups in the order of their first row)."""
    groups: dict[tuple, list[Row]] = {}
    for row in matrix().rows:
        groups.setdefault(reference_key(row), []).append(row)
    return [row for rows in groups.values() for row in rows]


CASES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_matrix.txt")
"""``generate()``'s rows as ``python tests/_matrix.py --write`` wrote them (the generation
judges some 25,000 rows by ``TrainConfig.check()``: seconds, too slow for every collection);
``test_verify_matrix`` fails when the file is not what the table generates."""


def cases() -> list[Row]:
    """The cases, from ``CASES_FILE``."""
    rows = []
    with open(CASES_FILE) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                rows.append(dict(zip(TABLE, line.split(), strict=True)))
    return rows


def write() -> None:
    names = " ".join(TABLE)
    with open(CASES_FILE, "w") as f:
        f.write(
            "# The verification matrix's cases (tests/_matrix.py, tests/test_verify_matrix.py),\n"
            "# written by python tests/_matrix.py --write: one a line, the levels of\n"
            f"# {names}\n"
            "# (those sharing their single-process references one after the other).\n"
        )
        for row in generate():
            f.write(" ".join(row.values()) + "\n")


#: the compile set: one case of the matrix run again with --compile (TP collectives, MoE over
#: EP and packed documents inside compiled blocks); it shares the case's references
COMPILED = dict(
    model="llama",
    experts="moe",
    router="softmax",
    precision="fp32",
    optimizer="adamw",
    documents="docs",
    mtp="mtp0",
    loss="ce",
    tp="tp2",
    pp="pp1",
    dp="dp2",
    zero="z1",
    ep="ep2",
    cp="cp1",
    recompute="none",
)


# -- every rank's gradients -------------------------------------------------------------------


@contextlib.contextmanager
def gradients(directory: str):
    """While inside: every rank of a run forked from this process writes, at each optimizer
    step, the reduced gradient its data-parallel wrapper hands the optimizer (after the
    reduction over DP / EP, the tied embedding's sum over stages, before unscaling and
    clipping), as (step, name, global flat indices, values unscaled) per parameter piece, to
    ``directory/rank<R>.pt``. Patches the trainer's classes in this process (a forked rank
    inherits them); ``read_gradients`` collects them."""
    import fastpar.parallel.data.family as family
    from fastpar.checkpoint.state import checkpoint_name
    from fastpar.train.build import Trainer

    real = (Trainer.__init__, Trainer.step, family.FlatDataParallel.step, family.unscale_and_agree)

    def init(self, *args, **kwargs):
        real[0](self, *args, **kwargs)
        _capture.update(trainer=self, records=[], step=0, routing=[])
        _routes["names"] = {
            id(p): checkpoint_name(n, p) for n, p in self.named_parameters().items()
        }

    def step(self, *args, **kwargs):
        _capture["step"] = self.step_count
        return real[1](self, *args, **kwargs)

    def dp_step(self):
        _capture["wrapper"] = self
        return real[2](self)

    def unscale(passes, scaler, device, **kwargs):
        _record(directory, scaler)
        return real[3](passes, scaler, device, **kwargs)

    Trainer.__init__, Trainer.step = init, step
    family.FlatDataParallel.step, family.unscale_and_agree = dp_step, unscale
    try:
        with pool.forking("the matrix's gradient capture patches the trainer's classes"):
            yield
    finally:
        Trainer.__init__, Trainer.step = real[0], real[1]
        family.FlatDataParallel.step, family.unscale_and_agree = real[2], real[3]
        _capture.clear()


def _record(directory: str, scaler) -> None:
    """This rank's pieces of the reduced gradients of the step under way (see ``gradients``)."""
    import torch.distributed as dist

    from fastpar.checkpoint.state import checkpoint_name, global_index

    trainer, dp = _capture["trainer"], _capture["wrapper"]
    names = {id(p): checkpoint_name(n, p) for n, p in trainer.named_parameters().items()}
    scale = 1.0 if scaler is None else float(scaler.scale)
    for f in dp.flats:
        if f.reduced is None:
            continue
        src = f.grad if f.in_place else f.reduced
        for o in f.owned():
            p = f.params[o.index]
            stand = torch.empty(f.shapes[o.index])  # (ZeRO-3 frees the parameter's data)
            stand.__dict__.update(p.__dict__)  # its placement marks
            where = global_index(stand).reshape(-1)[o.start : o.stop]
            values = src[o.shard_start : o.shard_stop].detach().double() / scale
            _capture["records"].append((_capture["step"], names[id(p)], where, values))
    path = os.path.join(directory, f"rank{dist.get_rank()}.pt")
    torch.save(_capture["records"], path)
    path = os.path.join(directory, f"routing{dist.get_rank()}.pt")
    torch.save(_capture["routing"], path)


def read_gradients(directory: str) -> list:
    """Every rank's records (``gradients``)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "rank*.pt"))):
        out += torch.load(path, weights_only=True)
    return out


def read_routing(directory: str) -> list:
    """Every rank's routing events (``routes``)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "routing*.pt"))):
        out += torch.load(path, weights_only=False)
    return out


def judge_gradients(refs, records: list, steps: int) -> tuple[bool, list[str]]:
    """Each rank's piece of each parameter's reduced gradient at each step against the
    references' gradient by the tolerance rule (steps the single process skipped left out),
    and every element of every parameter's gradient seen at every step on some rank."""
    from fastpar import tolerance

    bad, seen, worst = [], {}, []
    for step, name, where, values in records:
        if refs.single.skipped[step]:
            continue
        keep = where >= 0  # (padding of a TP-split dimension)
        where, values = where[keep], values[keep]
        full = [r.grads[step][name].reshape(-1)[where] for r in (refs.single, refs.twin)]
        exact = refs.exact.grads[step][name].reshape(-1)[where]
        c = tolerance.compare(
            values,
            full,
            exact,
            length=refs.length,
            dtype=refs.dtype,
            what=f"{name} (gradient of step {step + 1})",
        )
        worst.append(c)
        if not c.ok:
            bad.append(str(c))
        seen.setdefault((step, name), []).append(where)
    for step in range(steps):
        if refs.single.skipped[step]:
            continue
        for name, g in refs.exact.grads[step].items():
            got = seen.get((step, name), [])
            n = int(torch.unique(torch.cat(got)).numel()) if got else 0
            if n != g.numel():
                bad.append(f"{name}: gradient of step {step + 1}: {n} of {g.numel()} elements seen")
    w = tolerance.worst(worst)
    head = f"{len(records)} gradient pieces judged" + (f"; worst: {w}" if w is not None else "")
    return not bad, [head, *bad]


def verify(cfg: TrainConfig, tokens=None, cache=None) -> tuple[bool, str]:
    """``fastpar.verify.compare`` of ``cfg`` (references from ``cache``, or computed here),
    with every rank's reduced gradients judged too (``gradients``): (agree, the report). The
    references come first: the ranks fork from a process that has run the model's code."""
    from fastpar.train import load_data
    from fastpar.verify import ReferenceCache, compare

    tokens = load_data(cfg) if tokens is None else tokens
    cache = ReferenceCache() if cache is None else cache
    store: dict = {}
    computed = cache.computed
    with recording_routes(store):
        refs = cache.references(cfg, tokens)
    if cache.computed > computed:  # (else the cache's, computed here before)
        refs.routes = route_tables(store, refs.dtype, refs.length)
    tables = getattr(refs, "routes", None)
    if tables is None:
        raise RuntimeError("the cached references were computed without their routing")
    with tempfile.TemporaryDirectory(prefix="fastpar-grads-") as where:
        with gradients(where), routes(tables):
            ok, text = compare(dataclasses.replace(cfg), tokens, cache=cache)
        records, events = read_gradients(where), read_routing(where)
    good, lines = judge_gradients(refs, records, cfg.steps)
    if not records:
        good, lines = False, ["no gradient recorded: the ranks did not run the patched trainer"]
    # (a router on the ranks that the float64 run did not record is judged too: "unknown")
    routed, route_lines = judge_routing(tables, events) if tables or events else (True, [])
    good = good and routed
    verdict = "AGREE" if ok and good else "DISAGREE"
    out = [text, *(["every router's choice:", *route_lines] if tables or events else [])]
    return ok and good, "\n".join([*out, "every rank's gradients:", *lines, verdict])


# -- printing -----------------------------------------------------------------------------------
def text() -> str:
    """The cases (one a line: its references' group, every factor's level), the pair
    coverage, how many pairs each case covers first, and the excluded pairs with why."""
    cov, rows = matrix(), generate()
    refs: dict[tuple, int] = {}
    widths = {f.name: max(len(f.name), *(len(v) for v in f.levels)) for f in cov.factors}
    out = ["  ".join(["case", "refs", "new"] + [f.name.ljust(widths[f.name]) for f in FACTORS])]
    seen: set = set()
    for i, row in enumerate(rows):
        group = refs.setdefault(reference_key(row), len(refs))
        mine = set(row_pairs(cov.factors, row))
        new, seen = len(mine - seen), seen | mine
        levels = [row[f.name].ljust(widths[f.name]) for f in FACTORS]
        out.append("  ".join([f"{i:>4}", f"{group:>4}", f"{new:>3}", *levels]))
    required, held = cov.required, {p for row in rows for p in row_pairs(cov.factors, row)}
    out += [
        "",
        f"{len(rows)} cases (a covering array needs {cov.lower_bound()} at least), "
        f"{len(refs)} single-process references (each its run, twin and float64, computed "
        f"once and shared by the cases of its group)",
        f"{len(cov.pairs)} pairs of levels of two factors: {sum(p in held for p in required)} "
        f"of the {len(required)} some valid run holds are covered; {len(cov.excluded)} "
        f"excluded; the oracle judged {cov.checks} rows",
        "",
        "excluded pairs (no valid run holds them):",
    ]
    if not os.path.exists(CASES_FILE) or cases() != rows:
        out.insert(0, f"({CASES_FILE} holds other cases: python tests/_matrix.py --write)\n")
    for (a, b), why in cov.excluded.items():
        out.append(f"  {a[0]}={a[1]} x {b[0]}={b[1]}: {why.splitlines()[0]}")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
        print(f"wrote {CASES_FILE}")
    else:
        print(text())
